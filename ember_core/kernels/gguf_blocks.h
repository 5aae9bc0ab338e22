// GGUF block formats the CPU kernels read in place (ggml's block_q4_0, q4_1, q5_0, q5_1, q8_0,
// q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, and rows of float16 or bfloat16), and their expansion to float32, 32 values at a
// time, with exactly the values gguf-py's dequantization (or torch's .float()) gives. Every step of an expansion is exact but the last, which rounds once as
// gguf-py's last numpy operation does, so a kernel over blocks is bit-identical to one over the
// dequantized float32 weights.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "vec8.h"

namespace {

enum BlockFormat : int64_t {
  kQ4_1 = 0, kQ8_0 = 1, kQ4_K = 2, kQ6_K = 3, kF16 = 4, kBF16 = 5, kQ4_0 = 6, kQ5_0 = 7, kQ5_1 = 8, kQ5_K = 9,
  kQ2_K = 10, kQ3_K = 11, kIQ4_NL = 12, kIQ4_XS = 13
};

struct BlockLayout {
  int64_t values, bytes;  // weights per block, bytes per block
};

constexpr BlockLayout kBlockLayouts[] = {
    {32, 20},    // Q4_1: float16 d, float16 m, 16 bytes of 4-bit q: value = d * q + m
    {32, 34},    // Q8_0: float16 d, 32 int8 q: value = d * q
    {256, 144},  // Q4_K: float16 d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit q
    {256, 210},  // Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, float16 d
    {32, 64},    // F16: plain float16 values (a "block" is just the 32 values expanded at a time)
    {32, 64},    // BF16: plain bfloat16 values
    {32, 18},    // Q4_0: float16 d, 16 bytes of 4-bit q: value = d * (q - 8)
    {32, 22},    // Q5_0: float16 d, 32 bits of fifth bits, 16 bytes of low 4 bits: value = d * (q - 16)
    {32, 24},    // Q5_1: float16 d, m, 32 fifth bits, 16 bytes of low 4 bits: value = d * q + m
    {256, 176},  // Q5_K: Q4_K's d, dmin and scales, 32 bytes of fifth bits, 128 bytes of low 4 bits
    {256, 84},   // Q2_K: 16 bytes of 4-bit scale and min per 16 values, 64 bytes of 2-bit q, float16 d, dmin
    {256, 110},  // Q3_K: 32 bytes of third bits, 64 of low 2 bits, 12 of 6-bit scales, float16 d
    {32, 18},    // IQ4_NL: float16 d, 16 bytes of 4-bit indices into kIQ4Values: value = d * kIQ4Values[q]
    {256, 136},  // IQ4_XS: float16 d, 16 + 32 bits of 6-bit scales, 128 bytes of 4-bit indices
};

// ggml's kvalues_iq4nl: the non-linear levels IQ4_NL's and IQ4_XS's 4-bit indices pick.
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Asks for the blocks of rows [first_row, first_row + count) of an n-row weight, clipped to it:
// into L1 (Locality 3) or L2 (2). A tile kernel asks for its next tile's while it computes this one:
// a thread's tiles are short stretches of memory, taken by turns with the other threads, which the
// hardware prefetchers pick up too late.
template <int Locality = 3>
inline void prefetch_block_rows(const uint8_t* blocks, int64_t row_bytes, int64_t n, int64_t first_row, int64_t count) {
  const uint8_t* end = blocks + std::min(first_row + count, n) * row_bytes;
  for (const uint8_t* line = blocks + std::min(first_row, n) * row_bytes; line < end; line += 64)
    __builtin_prefetch(line, 0, Locality);
}

// Brings [begin, end) into L2 a slice per step() over `steps` calls: a tile kernel asks for its
// next tile's bytes spread over the blocks of this one. Asked for all at once (prefetch_block_rows),
// they fill the core's miss buffers and this tile's own loads wait behind them: a one-row int8
// linear streamed 14.8 GB/s that way and 20 GB/s spread (Zen 4, Q5_0 9728 x 896, two threads).
class SpreadPrefetch {
 public:
  SpreadPrefetch(const uint8_t* begin, const uint8_t* end, int64_t steps)
      : line_(begin), end_(end), per_step_(end > begin ? ((end - begin) / steps + 64) / 64 * 64 : 0) {}

  void step() {
    for (const uint8_t* stop = std::min(line_ + per_step_, end_); line_ < stop; line_ += 64) __builtin_prefetch(line_, 0, 2);
  }

 private:
  const uint8_t* line_;
  const uint8_t* end_;
  int64_t per_step_;
};

// The bytes of rows [first_row, first_row + count) of an n-row weight, clipped to it, as a SpreadPrefetch.
inline SpreadPrefetch spread_prefetch_rows(const uint8_t* blocks, int64_t row_bytes, int64_t n, int64_t first_row, int64_t count,
                                           int64_t steps) {
  return {blocks + std::min(first_row, n) * row_bytes, blocks + std::min(first_row + count, n) * row_bytes, steps};
}

constexpr int64_t kSubBlockValues = 32;  // values expanded at a time
constexpr int64_t kSubBlockVectors = kSubBlockValues / kLanes;

inline BlockLayout block_layout(int64_t format) {
  TORCH_CHECK(format >= kQ4_1 && format <= kIQ4_XS, "unknown GGUF block format ", format,
              " (0 = Q4_1, 1 = Q8_0, 2 = Q4_K, 3 = Q6_K, 4 = F16, 5 = BF16, 6 = Q4_0, 7 = Q5_0, 8 = Q5_1, 9 = Q5_K, "
              "10 = Q2_K, 11 = Q3_K, 12 = IQ4_NL, 13 = IQ4_XS)");
  return kBlockLayouts[format];
}

// Calls f(std::integral_constant<int64_t, format>{}) so kernels are compiled per format.
template <typename F>
void with_block_format(int64_t format, F&& f) {
  block_layout(format);  // rejects unknown formats
  switch (format) {
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    case kF16: return f(std::integral_constant<int64_t, kF16>{});
    case kBF16: return f(std::integral_constant<int64_t, kBF16>{});
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ2_K: return f(std::integral_constant<int64_t, kQ2_K>{});
    case kQ3_K: return f(std::integral_constant<int64_t, kQ3_K>{});
    case kIQ4_NL: return f(std::integral_constant<int64_t, kIQ4_NL>{});
    default: return f(std::integral_constant<int64_t, kIQ4_XS>{});
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K's 6-bit scale and min of sub-block j from its 12 packed bytes (ggml's get_scale_min_k4).
inline void q4_k_scale_min(const uint8_t* packed, int64_t j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// The factors a sub-block's integers are scaled by, as gguf-py forms them in float32 (exact:
// float16 times a 6- or 8-bit integer): Q4_K's and Q5_K's d * scale and dmin * min, Q6_K's
// d * scale of each half. Returns {first, second}.
template <int64_t Format>
inline std::pair<float, float> sub_block_factors(const uint8_t* block, int64_t sub) {
  if constexpr (Format == kQ4_K || Format == kQ5_K) {
    int scale, min;
    q4_k_scale_min(block + 4, sub, scale, min);
    return {half_at(block) * static_cast<float>(scale), half_at(block + 2) * static_cast<float>(min)};
  } else {
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_at(block + 208);
    return {d * static_cast<float>(scales[2 * sub]), d * static_cast<float>(scales[2 * sub + 1])};
  }
}

// Q3_K's signed 6-bit scale of the 16 values i (0-15) from its 12 packed bytes: the low 4 bits
// from bytes 0-7, the high 2 from bytes 8-11.
inline int q3_k_scale(const uint8_t* packed, int64_t i) {
  const int low = i < 8 ? packed[i] & 0xF : packed[i - 8] >> 4;
  const int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// Q2_K's and Q3_K's factors of the 16 values `half` (0-15), as gguf-py forms them in float32
// (exact): Q2_K's {d * scale, dmin * min}, Q3_K's {d * scale, 0}.
template <int64_t Format>
inline std::pair<float, float> sixteen_value_factors(const uint8_t* block, int64_t half) {
  if constexpr (Format == kQ2_K)
    return {half_at(block + 80) * static_cast<float>(block[half] & 0xF), half_at(block + 82) * static_cast<float>(block[half] >> 4)};
  else
    return {half_at(block + 108) * static_cast<float>(q3_k_scale(block + 96, half)), 0.0f};
}

// IQ4_NL's and IQ4_XS's factor of sub-block `sub` and the 16 bytes of its indices (values 0-15 are
// their low nibbles, 16-31 the high ones). IQ4_XS's signed 6-bit scale takes its low 4 bits from
// the nibble `sub` of bytes 4-7 and its high 2 from bits 2 sub of the 16 at bytes 2-3; d * scale
// is exact in float32, as gguf-py forms it.
template <int64_t Format>
inline std::pair<float, const uint8_t*> iq4_factor_and_indices(const uint8_t* block, int64_t sub) {
  if constexpr (Format == kIQ4_NL) {
    return {half_at(block), block + 2};
  } else {
    uint16_t high_bits;
    std::memcpy(&high_bits, block + 2, sizeof(high_bits));
    const int scale = (((block[4 + sub / 2] >> (4 * (sub % 2))) & 0xF) | (((high_bits >> (2 * sub)) & 3) << 4)) - 32;
    return {half_at(block) * static_cast<float>(scale), block + 8 + 16 * sub};
  }
}

// Q6_K's sub-block `sub` (values 32 sub to 32 sub + 31) takes its low 4 bits from 32 bytes of ql
// shifted by 0 or 4 and its high 2 bits from 32 bytes of qh shifted by 0, 2, 4 or 6 (ggml's layout).
struct Q6KSources {
  const uint8_t *low, *high;
  int low_shift, high_shift;
};

inline Q6KSources q6_k_sources(const uint8_t* block, int64_t sub) {
  const int64_t half = sub / 4, quarter = sub % 4;
  return {block + 64 * half + 32 * (quarter % 2), block + 128 + 32 * half, static_cast<int>(4 * (quarter / 2)),
          static_cast<int>(2 * quarter)};
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256i widen_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Q4_0, Q5_0, Q5_1: the low 4 bits of values 8j to 8j + 7; values 0-15 are the low nibbles of the
// 16 bytes at q, values 16-31 the high ones.
inline __m256i low_nibbles(const uint8_t* q, int64_t j) {
  const __m256i bytes = widen_bytes(q + (j % 2) * kLanes);
  return j < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(bytes, 4);
}

// Q5_0, Q5_1: the fifth bits of values 8j to 8j + 7 (bit i of the 32 little-endian bits at high
// is value i's), in place (16 or 0).
inline __m256i fifth_bits(const uint8_t* high, int64_t j) {
  uint32_t bits;
  std::memcpy(&bits, high, sizeof(bits));
  const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(j * kLanes)));
  return _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits)), shifts), _mm256_set1_epi32(1)), 4);
}

// The float32 values of sub-block `sub` of a block, in registers. Q4_1's d * q + m and Q4_K's
// d * q - dm are one FMA: d * q is exact, so rounding once equals gguf-py's two roundings of which
// the first is exact.
template <int64_t Format>
inline void expand_sub_block(const uint8_t* block, int64_t sub, vfloat (&values)[kSubBlockVectors]) {
  if constexpr (Format == kQ4_1) {
    // d and m, the block's two leading halves, go to every 32-bit lane and widen together:
    // [d, m, d, m, ...]; in-lane permutes then spread each one.
    const __m256 pairs = _mm256_cvtph_ps(_mm_castps_si128(_mm_broadcast_ss(reinterpret_cast<const float*>(block))));
    const __m256 d = _mm256_permute_ps(pairs, 0x00), m = _mm256_permute_ps(pairs, 0x55);
    const __m256i low_nibble = _mm256_set1_epi32(0x0F);
    // Value j is the low nibble of q[j], value j + 16 the high one: each widened half of q gives two vectors.
    for (int64_t half = 0; half < 2; ++half) {
      const __m256i bytes = widen_bytes(block + 4 + half * kLanes);
      values[half] = reinterpret_cast<vfloat>(_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low_nibble)), m));
      values[half + 2] = reinterpret_cast<vfloat>(_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), m));
    }
  } else if constexpr (Format == kQ8_0) {
    uint16_t bits;
    std::memcpy(&bits, block, sizeof(bits));
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<int16_t>(bits)));
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + j * kLanes)));
      values[j] = reinterpret_cast<vfloat>(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
    }
  } else if constexpr (Format == kQ4_0 || Format == kQ5_0 || Format == kQ5_1) {
    const __m256 d = _mm256_set1_ps(half_at(block));
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      if constexpr (Format == kQ4_0) {
        const __m256i q = _mm256_sub_epi32(low_nibbles(block + 2, j), _mm256_set1_epi32(8));
        values[j] = reinterpret_cast<vfloat>(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
      } else if constexpr (Format == kQ5_0) {
        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low_nibbles(block + 6, j), fifth_bits(block + 2, j)), _mm256_set1_epi32(16));
        values[j] = reinterpret_cast<vfloat>(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
      } else {
        const __m256i q = _mm256_or_si256(low_nibbles(block + 8, j), fifth_bits(block + 4, j));
        values[j] = reinterpret_cast<vfloat>(_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), _mm256_set1_ps(half_at(block + 2))));
      }
    }
  } else if constexpr (Format == kQ4_K || Format == kQ5_K) {
    // Sub-blocks 2i and 2i + 1 are the low and high nibbles of the same 32 bytes; Q5_K's fifth bit
    // of value e of sub-block c is bit c of its e-th byte of fifth bits.
    const auto [scale, min] = sub_block_factors<Format>(block, sub);
    const __m256 d = _mm256_set1_ps(scale), negative_dm = _mm256_set1_ps(-min);
    const uint8_t* q = block + (Format == kQ4_K ? 16 : 48) + 32 * (sub / 2);
    const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(4 * (sub % 2))), high_shift = _mm_cvtsi32_si128(static_cast<int>(sub));
    const __m256i low_nibble = _mm256_set1_epi32(0x0F);
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      __m256i nibbles = _mm256_and_si256(_mm256_srl_epi32(widen_bytes(q + j * kLanes), shift), low_nibble);
      if constexpr (Format == kQ5_K) {
        const __m256i high = _mm256_and_si256(_mm256_srl_epi32(widen_bytes(block + 16 + j * kLanes), high_shift), _mm256_set1_epi32(1));
        nibbles = _mm256_or_si256(nibbles, _mm256_slli_epi32(high, 4));
      }
      values[j] = reinterpret_cast<vfloat>(_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(nibbles), negative_dm));
    }
  } else if constexpr (Format == kQ2_K || Format == kQ3_K) {
    // Sub-block c's low 2 bits are bits 2 (c % 4) of 32 bytes of q; Q3_K's third bit is bit c of its
    // byte of hmask, and a clear bit subtracts 4. Each 16 values have their own factors.
    const uint8_t* q = block + (Format == kQ2_K ? 16 : 32) + 32 * (sub / 4);
    const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(2 * (sub % 4))), high_shift = _mm_cvtsi32_si128(static_cast<int>(sub));
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      const auto [scale, min] = sixteen_value_factors<Format>(block, 2 * sub + j / 2);
      __m256i low = _mm256_and_si256(_mm256_srl_epi32(widen_bytes(q + j * kLanes), shift), _mm256_set1_epi32(3));
      if constexpr (Format == kQ2_K) {
        values[j] = reinterpret_cast<vfloat>(_mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(low), _mm256_set1_ps(-min)));
      } else {
        const __m256i third = _mm256_and_si256(_mm256_srl_epi32(widen_bytes(block + j * kLanes), high_shift), _mm256_set1_epi32(1));
        low = _mm256_sub_epi32(low, _mm256_slli_epi32(_mm256_xor_si256(third, _mm256_set1_epi32(1)), 2));
        values[j] = reinterpret_cast<vfloat>(_mm256_mul_ps(_mm256_cvtepi32_ps(low), _mm256_set1_ps(scale)));
      }
    }
  } else if constexpr (Format == kIQ4_NL || Format == kIQ4_XS) {
    // A byte shuffle looks up 16 indices at once in the 16 levels.
    const auto [factor, indices] = iq4_factor_and_indices<Format>(block, sub);
    const __m256 d = _mm256_set1_ps(factor);
    const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)), low_nibble = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(indices));
    const __m128i picked[2] = {_mm_shuffle_epi8(levels, _mm_and_si128(bytes, low_nibble)),
                               _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble))};
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      const __m128i eight = j % 2 ? _mm_srli_si128(picked[j / 2], 8) : picked[j / 2];
      values[j] = reinterpret_cast<vfloat>(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), d));
    }
  } else if constexpr (Format == kF16) {
    for (int64_t j = 0; j < kSubBlockVectors; ++j)
      values[j] = reinterpret_cast<vfloat>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + j * 16))));
  } else if constexpr (Format == kBF16) {
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      const __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + j * 16)));
      values[j] = reinterpret_cast<vfloat>(_mm256_slli_epi32(halves, 16));
    }
  } else {
    const auto [first, second] = sub_block_factors<Format>(block, sub);
    const Q6KSources source = q6_k_sources(block, sub);
    const __m128i low_shift = _mm_cvtsi32_si128(source.low_shift), high_shift = _mm_cvtsi32_si128(source.high_shift);
    const __m256i low_bits = _mm256_set1_epi32(0x0F), high_bits = _mm256_set1_epi32(0x03), offset = _mm256_set1_epi32(32);
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      const __m256i low = _mm256_and_si256(_mm256_srl_epi32(widen_bytes(source.low + j * kLanes), low_shift), low_bits);
      const __m256i high = _mm256_and_si256(_mm256_srl_epi32(widen_bytes(source.high + j * kLanes), high_shift), high_bits);
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), offset);
      values[j] = reinterpret_cast<vfloat>(_mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(j < 2 ? first : second)));
    }
  }
}
#if EMBER_AVX512
// Formats whose 32 values also expand as two 16-float vectors: expand_sub_block's operations on
// twice the lanes, so the same values, in half the instructions.
template <int64_t Format>
constexpr bool kExpandsSixteenWide = Format == kQ4_1 || Format == kQ8_0;

// A block's 32 values as two 16-float vectors.
struct SixteenWide {
  __m512 low, high;  // values 0-15, 16-31
};

template <int64_t Format>
inline SixteenWide block_sixteen_wide(const uint8_t* block) {
  static_assert(kExpandsSixteenWide<Format>);
  if constexpr (Format == kQ4_1) {
    const __m512 pairs = _mm512_cvtph_ps(_mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(block))));
    const __m512 d = _mm512_permute_ps(pairs, 0x00), m = _mm512_permute_ps(pairs, 0x55);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    return {_mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F))), m),
            _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), m)};
  } else {
    const __m512 d = _mm512_set1_ps(half_at(block));
    const auto half = [&](int64_t h) -> __m512 {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * h));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    };
    return {half(0), half(1)};
  }
}

template <int64_t Format>
inline void expand_block_sixteen_wide(const uint8_t* block, float* out) {
  const SixteenWide values = block_sixteen_wide<Format>(block);
  _mm512_storeu_ps(out, values.low);
  _mm512_storeu_ps(out + 16, values.high);
}
#endif
#else
template <typename Integer>
inline vfloat to_floats(const Integer* p) {
  vfloat out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = static_cast<float>(p[i]);
  return out;
}

// The float32 values of sub-block `sub` of a block, in the order gguf-py computes them.
template <int64_t Format>
inline void expand_sub_block(const uint8_t* block, int64_t sub, vfloat (&values)[kSubBlockVectors]) {
  int q[kSubBlockValues];
  if constexpr (Format == kQ4_1) {
    const vfloat d = broadcast(half_at(block)), m = broadcast(half_at(block + 2));
    // Value j is the low nibble of q[j], value j + 16 the high one.
    for (int64_t i = 0; i < kSubBlockValues / 2; ++i) {
      q[i] = block[4 + i] & 0xF;
      q[i + kSubBlockValues / 2] = block[4 + i] >> 4;
    }
    for (int64_t j = 0; j < kSubBlockVectors; ++j) values[j] = d * to_floats(q + j * kLanes) + m;
  } else if constexpr (Format == kQ8_0) {
    const vfloat d = broadcast(half_at(block));
    const int8_t* bytes = reinterpret_cast<const int8_t*>(block + 2);
    for (int64_t j = 0; j < kSubBlockVectors; ++j) values[j] = to_floats(bytes + j * kLanes) * d;
  } else if constexpr (Format == kQ4_0 || Format == kQ5_0 || Format == kQ5_1) {
    constexpr int64_t kLowBits = Format == kQ4_0 ? 2 : Format == kQ5_0 ? 6 : 8;
    uint32_t fifth_bits = 0;
    if constexpr (Format != kQ4_0) std::memcpy(&fifth_bits, block + kLowBits - 4, sizeof(fifth_bits));
    for (int64_t i = 0; i < kSubBlockValues; ++i) {
      const int low = i < 16 ? block[kLowBits + i] & 0xF : block[kLowBits + i - 16] >> 4;
      q[i] = low | static_cast<int>(((fifth_bits >> i) & 1) << 4);
      q[i] -= Format == kQ4_0 ? 8 : Format == kQ5_0 ? 16 : 0;
    }
    const vfloat d = broadcast(half_at(block));
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      if constexpr (Format == kQ5_1)
        values[j] = d * to_floats(q + j * kLanes) + half_at(block + 2);
      else
        values[j] = to_floats(q + j * kLanes) * d;
    }
  } else if constexpr (Format == kQ4_K || Format == kQ5_K) {
    const auto [scale, min] = sub_block_factors<Format>(block, sub);
    const uint8_t* bytes = block + (Format == kQ4_K ? 16 : 48) + 32 * (sub / 2);
    for (int64_t i = 0; i < kSubBlockValues; ++i) {
      q[i] = (bytes[i] >> (4 * (sub % 2))) & 0xF;
      if constexpr (Format == kQ5_K) q[i] |= ((block[16 + i] >> sub) & 1) << 4;
    }
    for (int64_t j = 0; j < kSubBlockVectors; ++j) values[j] = broadcast(scale) * to_floats(q + j * kLanes) - min;
  } else if constexpr (Format == kQ2_K || Format == kQ3_K) {
    const uint8_t* bytes = block + (Format == kQ2_K ? 16 : 32) + 32 * (sub / 4);
    for (int64_t i = 0; i < kSubBlockValues; ++i) {
      q[i] = (bytes[i] >> (2 * (sub % 4))) & 3;
      if constexpr (Format == kQ3_K) q[i] -= ((block[i] >> sub) & 1) ? 0 : 4;
    }
    for (int64_t j = 0; j < kSubBlockVectors; ++j) {
      const auto [scale, min] = sixteen_value_factors<Format>(block, 2 * sub + j / 2);
      values[j] = Format == kQ2_K ? broadcast(scale) * to_floats(q + j * kLanes) - min : to_floats(q + j * kLanes) * scale;
    }
  } else if constexpr (Format == kIQ4_NL || Format == kIQ4_XS) {
    const auto [factor, indices] = iq4_factor_and_indices<Format>(block, sub);
    for (int64_t i = 0; i < kSubBlockValues / 2; ++i) {
      q[i] = kIQ4Values[indices[i] & 0xF];
      q[i + kSubBlockValues / 2] = kIQ4Values[indices[i] >> 4];
    }
    for (int64_t j = 0; j < kSubBlockVectors; ++j) values[j] = to_floats(q + j * kLanes) * factor;
  } else if constexpr (Format == kF16 || Format == kBF16) {
    using Half = std::conditional_t<Format == kF16, c10::Half, c10::BFloat16>;
    for (int64_t i = 0; i < kSubBlockValues; ++i) {
      uint16_t bits;
      std::memcpy(&bits, block + 2 * i, sizeof(bits));
      values[i / kLanes][i % kLanes] = static_cast<float>(Half(bits, Half::from_bits()));
    }
  } else {
    const auto [first, second] = sub_block_factors<Format>(block, sub);
    const Q6KSources source = q6_k_sources(block, sub);
    for (int64_t i = 0; i < kSubBlockValues; ++i)
      q[i] = (((source.low[i] >> source.low_shift) & 0xF) | (((source.high[i] >> source.high_shift) & 3) << 4)) - 32;
    for (int64_t j = 0; j < kSubBlockVectors; ++j) values[j] = to_floats(q + j * kLanes) * (j < 2 ? first : second);
  }
}
#endif

}  // namespace
