// GGUF blocks as integers for the int8 linears (int8_linear.cpp): 32 weights of a block at a time as
// unsigned bytes u, in the values' own order, with per half (16 values) a float scale and either an
// integer offset or a float minimum, so that
//
//     weight = scale * (u - offset)        (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K, IQ4_NL, IQ4_XS)
//     weight = scale * u + minimum         (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)
//
// exactly the values gguf-py's dequantization gives (each scale and minimum is a float16 times a
// small integer, exact in float32; only `scale * u + minimum` may round, once). Signed 8-bit weights
// (Q8_0, the IQ4 levels) take u = w + 128 and offset 128, so every format's u is an unsigned byte,
// the operand VNNI's vpdpbusd and AVX2's vpmaddubsw want unsigned. A block's values come a row at a
// time, its factors for eight rows at once (vectors whose lanes are rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace {

using vbytes = uint8_t __attribute__((vector_size(32)));  // 32 unsigned bytes: one block's u
using vsbytes = int8_t __attribute__((vector_size(32)));  // 32 signed bytes: a block of quantized activations

constexpr int64_t kInt8BlockValues = 32;  // values a block of activations (and of u) holds

// log2 of the integer offset of a format whose weights are scale * (u - offset); -1 where they are
// scale * u + minimum instead.
template <int64_t Format>
constexpr int kOffsetShift = Format == kQ4_0 ? 3 : Format == kQ5_0 ? 4 : Format == kQ6_K ? 5 : Format == kQ3_K ? 2
                             : (Format == kQ8_0 || Format == kIQ4_NL || Format == kIQ4_XS) ? 7 : -1;

// Whether u may exceed 127 (signed weights shifted by 128).
template <int64_t Format>
constexpr bool kWideBytes = kOffsetShift<Format> == 7;

template <int64_t Format>
constexpr bool kReadsAsInt8 = Format != kF16 && Format != kBF16;

// Eight rows' blocks at once, lane r for row r: first + offsets[r] is row r's block.
struct RowBlocks {
  const uint8_t* first;
  vint offsets;

  // The 4 bytes at `at` of each row's block, little-endian.
  vuint dwords(int64_t at) const {
#if defined(__AVX2__)
    return reinterpret_cast<vuint>(_mm256_i32gather_epi32(reinterpret_cast<const int*>(first + at), reinterpret_cast<__m256i>(offsets), 1));
#else
    vuint out;
    for (int64_t r = 0; r < kLanes; ++r) std::memcpy(&out[r], first + offsets[r] + at, sizeof(uint32_t));
    return out;
#endif
  }

  // The low 16 bits of each lane, a float16, as float32 (exact).
  static vfloat halves_to_floats(vuint bits) {
#if defined(__F16C__) && defined(__AVX2__)
    const __m256i packed = _mm256_shuffle_epi8(reinterpret_cast<__m256i>(bits),
                                               _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    return reinterpret_cast<vfloat>(_mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08))));
#else
    vfloat out;
    for (int64_t r = 0; r < kLanes; ++r) out[r] = static_cast<float>(c10::Half(static_cast<uint16_t>(bits[r]), c10::Half::from_bits()));
    return out;
#endif
  }
};

// Byte `at` of each row's block: from the dword holding it, never reading past `block_bytes`.
// `Rows` is a RowBlocks or a FactorDwords.
template <int64_t kBlockBytes, typename Rows>
vuint byte_at(const Rows& rows, int64_t at) {
  const int64_t start = std::min<int64_t>(at / 4 * 4, kBlockBytes - 4);
  return (rows.dwords(start) >> static_cast<uint32_t>(8 * (at - start))) & 0xFF;
}

// The float16 at `at` of each row's block, as float32.
template <int64_t kBlockBytes, typename Rows>
vfloat half_at(const Rows& rows, int64_t at) {
  const int64_t start = std::min<int64_t>(at, kBlockBytes - 4);
  return RowBlocks::halves_to_floats(rows.dwords(start) >> static_cast<uint32_t>(8 * (at - start)));
}

// Where a format keeps its factors (scales, minimums, their float16 multipliers): the aligned
// dwords [first, first + 4 * words) and, where `last` is set, the block's last dword, which
// byte_at and half_at read near the block's end.
struct FactorBytes {
  int64_t first, words;
  bool last;
};

template <int64_t Format>
constexpr FactorBytes kFactorBytes = Format == kQ4_K || Format == kQ5_K ? FactorBytes{0, 4, false}
                                     : Format == kQ6_K                  ? FactorBytes{192, 4, true}
                                     : Format == kQ3_K                  ? FactorBytes{96, 3, true}
                                     : Format == kQ2_K                  ? FactorBytes{0, 4, true}
                                     : Format == kIQ4_XS                ? FactorBytes{0, 2, false}
                                                                        : FactorBytes{0, 1, false};

// Eight rows' factor dwords of one block, gathered once for all its sub-blocks: group_factors
// reads them as it reads a RowBlocks, without a gather per sub-block.
template <int64_t Format>
struct FactorDwords {
  static constexpr FactorBytes kAt = kFactorBytes<Format>;
  static constexpr int64_t kLast = kBlockLayouts[Format].bytes - 4;
  RowBlocks rows;
  vuint words[kAt.words + 1];  // the aligned dwords, then the last one

  FactorDwords() = default;
  explicit FactorDwords(const RowBlocks& block_rows) : rows(block_rows) {
    for (int64_t i = 0; i < kAt.words; ++i) words[i] = rows.dwords(kAt.first + 4 * i);
    if constexpr (kAt.last) words[kAt.words] = rows.dwords(kLast);
  }

  vuint dwords(int64_t at) const {
    if (kAt.last && at == kLast) return words[kAt.words];
    const int64_t i = (at - kAt.first) / 4;
    if (at % 4 == 0 && i >= 0 && i < kAt.words) return words[i];
    return rows.dwords(at);  // not among the format's factor bytes: gathered where asked
  }
};

inline vfloat to_float(vuint v) { return __builtin_convertvector(reinterpret_cast<vint>(v), vfloat); }

// Per half of a block's 32 weights, for eight rows: the scale, and the minimum (0 for offset formats).
struct GroupFactors {
  vfloat scale[2], minimum[2];
};

// Sub-block `sub`'s factors of eight rows' blocks in `Format`: gguf_blocks.h's per-block formulas
// (sub_block_factors, sixteen_value_factors, iq4_factor_and_indices) on a vector of rows, exact.
template <int64_t Format, typename Rows>
__attribute__((always_inline)) inline GroupFactors group_factors(const Rows& rows, int64_t sub) {
  constexpr int64_t kBytes = kBlockLayouts[Format].bytes;
  const auto both = [](vfloat scale, vfloat minimum) { return GroupFactors{{scale, scale}, {minimum, minimum}}; };
  if constexpr (Format == kQ4_0 || Format == kQ5_0 || Format == kQ8_0 || Format == kIQ4_NL) {
    return both(half_at<kBytes>(rows, 0), vfloat{});
  } else if constexpr (Format == kQ4_1 || Format == kQ5_1) {
    const vuint head = rows.dwords(0);
    return both(RowBlocks::halves_to_floats(head), RowBlocks::halves_to_floats(head >> 16));
  } else if constexpr (Format == kIQ4_XS) {
    const vuint head = rows.dwords(0);  // d, then the 16 bits of the scales' high parts
    const vuint low = (byte_at<kBytes>(rows, 4 + sub / 2) >> static_cast<uint32_t>(4 * (sub % 2))) & 0xF;
    const vuint scale = low | (((head >> static_cast<uint32_t>(16 + 2 * sub)) & 3) << 4);
    return both(RowBlocks::halves_to_floats(head) * (to_float(scale) - 32.0f), vfloat{});
  } else if constexpr (Format == kQ4_K || Format == kQ5_K) {
    const vuint head = rows.dwords(0);  // d, dmin; then 12 bytes of 6-bit scales and mins (q4_k_scale_min)
    const auto packed = [&](int64_t i) { return byte_at<kBytes>(rows, 4 + i); };
    vuint scale, minimum;
    if (sub < 4) {
      scale = packed(sub) & 63, minimum = packed(sub + 4) & 63;
    } else {
      scale = (packed(sub + 4) & 0xF) | ((packed(sub - 4) >> 6) << 4);
      minimum = (packed(sub + 4) >> 4) | ((packed(sub) >> 6) << 4);
    }
    return both(RowBlocks::halves_to_floats(head) * to_float(scale), -(RowBlocks::halves_to_floats(head >> 16) * to_float(minimum)));
  } else if constexpr (Format == kQ6_K) {
    const vfloat d = half_at<kBytes>(rows, 208);
    const auto scale = [&](int64_t i) { return to_float(reinterpret_cast<vuint>((reinterpret_cast<vint>(byte_at<kBytes>(rows, 192 + i)) << 24) >> 24)); };
    return {{d * scale(2 * sub), d * scale(2 * sub + 1)}, {vfloat{}, vfloat{}}};
  } else if constexpr (Format == kQ3_K) {
    const vfloat d = half_at<kBytes>(rows, 108);
    const auto scale = [&](int64_t i) {  // q3_k_scale: low 4 bits from bytes 0-7, high 2 from bytes 8-11
      const vuint low = i < 8 ? byte_at<kBytes>(rows, 96 + i) & 0xF : byte_at<kBytes>(rows, 96 + i - 8) >> 4;
      const vuint high = (byte_at<kBytes>(rows, 96 + 8 + i % 4) >> static_cast<uint32_t>(2 * (i / 4))) & 3;
      return to_float(low | (high << 4)) - 32.0f;
    };
    return {{d * scale(2 * sub), d * scale(2 * sub + 1)}, {vfloat{}, vfloat{}}};
  } else {  // Q2_K: per 16 values a byte of 4-bit scale and min; d and dmin at the block's end
    const vuint tail = rows.dwords(80);
    const vfloat d = RowBlocks::halves_to_floats(tail), dmin = RowBlocks::halves_to_floats(tail >> 16);
    GroupFactors out;
    for (int64_t h = 0; h < 2; ++h) {
      const vuint packed = byte_at<kBytes>(rows, 2 * sub + h);
      out.scale[h] = d * to_float(packed & 0xF), out.minimum[h] = -(dmin * to_float(packed >> 4));
    }
    return out;
  }
}

// The factors of eight rows, 32-value block after 32-value block (in any order): each GGUF block's
// factor bytes gathered once, however many of its sub-blocks are asked for.
template <int64_t Format>
class RowFactors {
 public:
  explicit RowFactors(const RowBlocks& rows) : rows_(rows) {}

  __attribute__((always_inline)) GroupFactors at(int64_t block) {
    constexpr BlockLayout layout = kBlockLayouts[Format];
    constexpr int64_t per_block = layout.values / kInt8BlockValues;
    if (block / per_block != gathered_) {
      gathered_ = block / per_block;
      bytes_ = FactorDwords<Format>(RowBlocks{rows_.first + gathered_ * layout.bytes, rows_.offsets});
    }
    return group_factors<Format>(bytes_, block % per_block);
  }

 private:
  RowBlocks rows_;
  int64_t gathered_ = -1;
  FactorDwords<Format> bytes_;
};

#if defined(__AVX2__)
inline vbytes as_bytes(__m256i v) { return reinterpret_cast<vbytes>(v); }

// Values 0-15 the low nibbles of 16 bytes, values 16-31 their high nibbles.
inline __m256i nibbles_in_order(const uint8_t* q) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low_nibble = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble), _mm_and_si128(bytes, low_nibble));
}

// Byte i: 16 where bit i of the 32 little-endian bits at p is set, else 0 (Q5_0's and Q5_1's fifth bits).
inline __m256i fifth_bits_as_sixteens(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  // Byte i takes byte i / 8 of the bits, then keeps bit i % 8 of it.
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// (bytes >> shift) & mask, byte by byte.
inline __m256i shifted_bits(const uint8_t* p, int shift, int mask) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

inline __m256i iq4_levels_plus_128(__m256i indices) {
  alignas(16) static constexpr uint8_t kShifted[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
  static_assert(kIQ4Values[0] + 128 == 1 && kIQ4Values[15] + 128 == 241);
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kShifted))), indices);
}
#endif

// Sub-block `sub` (values 32 sub to 32 sub + 31) of a block in `Format`: the 32 values' u.
template <int64_t Format>
__attribute__((always_inline)) inline vbytes integer_values(const uint8_t* block, int64_t sub) {
#if defined(__AVX2__)
  if constexpr (Format == kQ4_0 || Format == kQ4_1) {
    return as_bytes(nibbles_in_order(block + (Format == kQ4_0 ? 2 : 4)));
  } else if constexpr (Format == kQ5_0 || Format == kQ5_1) {
    constexpr int64_t kHigh = Format == kQ5_0 ? 2 : 4;
    return as_bytes(_mm256_or_si256(nibbles_in_order(block + kHigh + 4), fifth_bits_as_sixteens(block + kHigh)));
  } else if constexpr (Format == kQ8_0) {
    return as_bytes(_mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)), _mm256_set1_epi8(-128)));
  } else if constexpr (Format == kIQ4_NL || Format == kIQ4_XS) {
    return as_bytes(iq4_levels_plus_128(nibbles_in_order(iq4_factor_and_indices<Format>(block, sub).second)));
  } else if constexpr (Format == kQ4_K || Format == kQ5_K) {
    __m256i u = shifted_bits(block + (Format == kQ4_K ? 16 : 48) + 32 * (sub / 2), static_cast<int>(4 * (sub % 2)), 0x0F);
    if constexpr (Format == kQ5_K) u = _mm256_or_si256(u, _mm256_slli_epi16(shifted_bits(block + 16, static_cast<int>(sub), 1), 4));
    return as_bytes(u);
  } else if constexpr (Format == kQ6_K) {
    const Q6KSources source = q6_k_sources(block, sub);
    return as_bytes(_mm256_or_si256(shifted_bits(source.low, source.low_shift, 0x0F),
                                    _mm256_slli_epi16(shifted_bits(source.high, source.high_shift, 0x03), 4)));
  } else {  // Q2_K, Q3_K
    __m256i u = shifted_bits(block + (Format == kQ2_K ? 16 : 32) + 32 * (sub / 4), static_cast<int>(2 * (sub % 4)), 0x03);
    // Q3_K: a set third bit adds 4 (weight d * scale * (low - 4 * (1 - third)) = d * scale * (u - 4)).
    if constexpr (Format == kQ3_K) u = _mm256_or_si256(u, _mm256_slli_epi16(shifted_bits(block, static_cast<int>(sub), 1), 2));
    return as_bytes(u);
  }
#else
  vbytes u;
  if constexpr (Format == kQ4_0 || Format == kQ4_1 || Format == kQ5_0 || Format == kQ5_1) {
    constexpr int64_t kLowBits = Format == kQ4_0 ? 2 : Format == kQ5_0 ? 6 : Format == kQ4_1 ? 4 : 8;
    uint32_t fifth_bits = 0;
    if constexpr (Format == kQ5_0 || Format == kQ5_1) std::memcpy(&fifth_bits, block + kLowBits - 4, sizeof(fifth_bits));
    for (int64_t i = 0; i < kInt8BlockValues; ++i)
      u[i] = static_cast<uint8_t>((i < 16 ? block[kLowBits + i] & 0xF : block[kLowBits + i - 16] >> 4) | (((fifth_bits >> i) & 1) << 4));
  } else if constexpr (Format == kQ8_0) {
    for (int64_t i = 0; i < kInt8BlockValues; ++i) u[i] = static_cast<uint8_t>(block[2 + i] ^ 0x80);
  } else if constexpr (Format == kIQ4_NL || Format == kIQ4_XS) {
    const uint8_t* indices = iq4_factor_and_indices<Format>(block, sub).second;
    for (int64_t i = 0; i < 16; ++i) {
      u[i] = static_cast<uint8_t>(kIQ4Values[indices[i] & 0xF] + 128);
      u[i + 16] = static_cast<uint8_t>(kIQ4Values[indices[i] >> 4] + 128);
    }
  } else if constexpr (Format == kQ4_K || Format == kQ5_K) {
    const uint8_t* q = block + (Format == kQ4_K ? 16 : 48) + 32 * (sub / 2);
    for (int64_t i = 0; i < kInt8BlockValues; ++i) {
      u[i] = static_cast<uint8_t>((q[i] >> (4 * (sub % 2))) & 0xF);
      if constexpr (Format == kQ5_K) u[i] |= static_cast<uint8_t>(((block[16 + i] >> sub) & 1) << 4);
    }
  } else if constexpr (Format == kQ6_K) {
    const Q6KSources source = q6_k_sources(block, sub);
    for (int64_t i = 0; i < kInt8BlockValues; ++i)
      u[i] = static_cast<uint8_t>(((source.low[i] >> source.low_shift) & 0xF) | (((source.high[i] >> source.high_shift) & 3) << 4));
  } else {  // Q2_K, Q3_K
    const uint8_t* q = block + (Format == kQ2_K ? 16 : 32) + 32 * (sub / 4);
    for (int64_t i = 0; i < kInt8BlockValues; ++i) {
      u[i] = static_cast<uint8_t>((q[i] >> (2 * (sub % 4))) & 3);
      if constexpr (Format == kQ3_K) u[i] |= static_cast<uint8_t>(((block[i] >> sub) & 1) << 2);
    }
  }
  return u;
#endif
}

// Calls f(std::integral_constant<int64_t, format>{}) for the formats the int8 linears read.
template <typename F>
void with_int8_block_format(int64_t format, F&& f) {
  with_block_format(format, [&](auto kind) {
    if constexpr (kReadsAsInt8<kind()>) {
      f(kind);
    } else {
      TORCH_CHECK(false, "int8_linear: 16-bit rows (format ", format, ") are not quantized weights; quantize them "
                  "to Q8_0 (quantize_q8_0) first");
    }
  });
}

}  // namespace
