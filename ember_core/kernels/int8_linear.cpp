// y = x W^T + b for the `fast` numerics: x quantized to int8, W's GGUF blocks read as integers
// (int8_blocks.h), integer dot products 32 values at a time, scaled in float32 per block.
//
// Each row of x is quantized on its own, per block of 32 values: scale = max |x| / 127 and
// q = round(x / scale), to nearest even. Eight weight rows sit across a vector's lanes: a block's
// integer sums for eight outputs come from eight dot-product instructions (VNNI's vpdpbusd, or
// AVX2's vpmaddubsw + vpmaddwd; plain loops elsewhere), each taking 4 values of the eight rows
// against 4 values of one x row, exact in int32. Then, per block (per half of 16 values where the
// format scales halves), every output takes the same float32 steps into its own lane:
//
//     acc = fma(float(sum(u * q) - offset * sum(q)), scale_w * scale_x, acc)
//     acc = fma(minimum_w, scale_x * sum(q), acc)          (formats with a minimum)
//
// so an output depends on its own rows of x and W only: the same bits at every row count, a
// decode's single row and a prompt's hundreds alike, whichever integer route a path takes. Against
// the float32 product over the dequantized weights it differs by x's rounding to 8 bits, at most
// half a step of 1/127 of its block's largest value: finer than the Q8_K activations (one scale
// per 256 values) that llama.cpp's K-quant kernels multiply by.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "gguf_blocks.h"
#include "int8_blocks.h"
#include "ops.h"
#include "parallel_tiles.h"
#include "vec8.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define EMBER_VNNI 1
#endif

// x quantized row by row, per block of 32 values, stored block by block: a block's rows are
// adjacent, so a tile addresses its rows' values at constant offsets from one pointer.
struct QuantizedRows {
  int64_t m, k, blocks;
  std::vector<int8_t> q;  // [blocks, m, 32]
  std::vector<float> scale;  // [blocks, m]
  std::vector<int32_t> half_sums;  // [blocks, m, 2]: the sum of q over each half
  std::vector<float> scaled_half_sums;  // [blocks, m, 2]: scale times each half's sum
  std::vector<int32_t> sums;  // [blocks, m]: the sum of q over the block
  std::vector<float> scaled_sums;  // [blocks, m]: scale times the block's sum

  int64_t at(int64_t row, int64_t block) const { return block * m + row; }
  const int8_t* block_q(int64_t row, int64_t block) const { return q.data() + at(row, block) * kInt8BlockValues; }
};

template <typename Value>
inline float as_float(Value v) {
  return static_cast<float>(v);
}

// One block of 32 values: its scale and q; returns the sums of q over each half.
template <typename Value>
std::pair<int32_t, int32_t> quantize_block(const Value* x, int8_t* q, float& scale) {
  float values[kInt8BlockValues];
  float largest = 0.0f;
  for (int64_t i = 0; i < kInt8BlockValues; ++i) {
    values[i] = as_float(x[i]);
    largest = std::max(largest, std::fabs(values[i]));
  }
  if (largest == 0.0f) {
    scale = 0.0f;
    std::memset(q, 0, kInt8BlockValues);
    return {0, 0};
  }
  scale = largest / 127.0f;
  const float inverse = 127.0f / largest;
  int32_t sums[2] = {0, 0};
  for (int64_t i = 0; i < kInt8BlockValues; ++i) {
    const int rounded = static_cast<int>(std::nearbyint(values[i] * inverse));  // to nearest even
    q[i] = static_cast<int8_t>(rounded);
    sums[i / 16] += rounded;
  }
  return {sums[0], sums[1]};
}

template <typename Value>
QuantizedRows quantize_rows(const Value* x, int64_t m, int64_t k) {
  const int64_t blocks = k / kInt8BlockValues;
  QuantizedRows rows{m, k, blocks, std::vector<int8_t>(m * k), std::vector<float>(m * blocks), std::vector<int32_t>(2 * m * blocks),
                     std::vector<float>(2 * m * blocks), std::vector<int32_t>(m * blocks), std::vector<float>(m * blocks)};
  at::parallel_for(0, m * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t source = begin; source < end; ++source) {  // row source / blocks, block source % blocks
      const int64_t i = rows.at(source / blocks, source % blocks);
      const auto [first, second] = quantize_block(x + source * kInt8BlockValues, rows.q.data() + i * kInt8BlockValues, rows.scale[i]);
      rows.half_sums[2 * i] = first, rows.half_sums[2 * i + 1] = second;
      rows.scaled_half_sums[2 * i] = rows.scale[i] * static_cast<float>(first);
      rows.scaled_half_sums[2 * i + 1] = rows.scale[i] * static_cast<float>(second);
      rows.sums[i] = first + second;
      rows.scaled_sums[i] = rows.scale[i] * static_cast<float>(first + second);
    }
  });
  return rows;
}

// Whether a format scales each half of a block on its own (Q2_K, Q3_K, Q6_K: a scale per 16 values).
template <int64_t Format>
constexpr bool kScalesHalves = Format == kQ2_K || Format == kQ3_K || Format == kQ6_K;

// On AVX2 without VNNI, a format whose u exceeds 127 (kWideBytes) would saturate vpmaddubsw's
// 16-bit pair sums: its weights are kept signed (w = u - 128) and multiplied as abs(w) * sign(q, w),
// so its offset is already applied.
#if defined(__AVX2__) && !defined(EMBER_VNNI)
template <int64_t Format>
constexpr bool kSignedWeights = kWideBytes<Format>;
#else
template <int64_t Format>
constexpr bool kSignedWeights = false;
#endif

constexpr int64_t kGroupRows = kLanes;  // weight rows across a vector's lanes

// One block of eight weight rows, lane r for row r.
struct GroupBlock {
  vbytes u[kLanes];  // u[i]: values 4i to 4i + 3 of each row, row r's in bytes 4r to 4r + 3
  vfloat scale[2], minimum[2];  // per half ([0] alone where the format scales whole blocks)
};

// u[i] from each row's u in the values' order: an 8 x 8 transpose of 4-byte groups.
__attribute__((always_inline)) inline void interleave_rows(const vbytes (&natural)[kLanes], vbytes (&u)[kLanes]) {
#if defined(__AVX2__)
  __m256i t[8], s[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_epi32(reinterpret_cast<__m256i>(natural[j]), reinterpret_cast<__m256i>(natural[j + 1]));
    t[j + 1] = _mm256_unpackhi_epi32(reinterpret_cast<__m256i>(natural[j]), reinterpret_cast<__m256i>(natural[j + 1]));
  }
  for (int j = 0; j < 8; j += 4) {
    s[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
    s[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
    s[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
    s[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    u[i] = reinterpret_cast<vbytes>(_mm256_permute2x128_si256(s[i], s[i + 4], 0x20));
    u[i + 4] = reinterpret_cast<vbytes>(_mm256_permute2x128_si256(s[i], s[i + 4], 0x31));
  }
#else
  for (int64_t i = 0; i < kLanes; ++i)
    for (int64_t r = 0; r < kLanes; ++r)
      for (int64_t j = 0; j < 4; ++j) u[i][4 * r + j] = natural[r][4 * i + j];
#endif
}

// Weight rows [row, row + rows), rows <= 8, as a RowBlocks at block 0; the lanes past `rows` repeat
// the last row (their outputs are not stored), so every load stays inside the weight and no lane branches.
inline RowBlocks group_rows(const uint8_t* blocks, int64_t row_bytes, int64_t row, int64_t rows) {
  vint offsets;
  for (int64_t r = 0; r < kLanes; ++r) offsets[r] = static_cast<int32_t>(std::min(r, rows - 1) * row_bytes);
  return {blocks + row * row_bytes, offsets};
}

// Block `block` of a group's rows, interleaved, with its factors.
template <int64_t Format>
__attribute__((always_inline)) inline void expand_group(const RowBlocks& rows, int64_t block, GroupBlock& g) {
  constexpr BlockLayout layout = kBlockLayouts[Format];
  constexpr int64_t per_block = layout.values / kInt8BlockValues;
  const RowBlocks at_block{rows.first + block / per_block * layout.bytes, rows.offsets};
  vbytes natural[kLanes];
#pragma GCC unroll 8
  for (int64_t r = 0; r < kLanes; ++r) {
    natural[r] = integer_values<Format>(at_block.first + at_block.offsets[r], block % per_block);
    if constexpr (kSignedWeights<Format>) natural[r] ^= 0x80;
  }
  interleave_rows(natural, g.u);
  const GroupFactors factors = group_factors<Format>(at_block, block % per_block);
  for (int64_t h = 0; h < 2; ++h) g.scale[h] = factors.scale[h], g.minimum[h] = factors.minimum[h];
}

// acc + 4 values of each of the group's rows (u[i]) times the same 4 values of x at q: exact.
template <int64_t Format>
inline vint dot_four(vint acc, vbytes u, const int8_t* q) {
  int32_t four;
  std::memcpy(&four, q, sizeof(four));
#if defined(EMBER_VNNI)
  return reinterpret_cast<vint>(
      _mm256_dpbusd_epi32(reinterpret_cast<__m256i>(acc), reinterpret_cast<__m256i>(u), _mm256_set1_epi32(four)));
#elif defined(__AVX2__)
  const __m256i x = _mm256_set1_epi32(four), w = reinterpret_cast<__m256i>(u);
  const __m256i pairs = kSignedWeights<Format> ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
                                               : _mm256_maddubs_epi16(w, x);
  return acc + reinterpret_cast<vint>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
  for (int64_t r = 0; r < kLanes; ++r)
    for (int64_t j = 0; j < 4; ++j) acc[r] += static_cast<int32_t>(u[4 * r + j]) * static_cast<int32_t>(q[j]);
  return acc;
#endif
}

// The offset's share of a block's (or half's) integer sums: - offset * sum(q), in every lane.
template <int64_t Format>
inline vint offset_share(int32_t sum) {
  if constexpr (kOffsetShift<Format> >= 0 && !kSignedWeights<Format>) return vint{} - sum * (1 << kOffsetShift<Format>);
  return vint{};
}

struct Problem {
  const QuantizedRows* x;
  const uint8_t* blocks;  // [n, row_bytes]
  int64_t n, row_bytes;
  const float* bias;  // [n] float32 or null
  void* y;  // [m, n], float32 or bfloat16
  bool bf16_out;
};

// Outputs [row, row + rows) of x row `xrow` from their accumulator, plus the bias.
inline void store_outputs(const Problem& p, vfloat acc, int64_t xrow, int64_t row, int64_t rows) {
  float totals[kLanes];
  std::memcpy(totals, &acc, sizeof(totals));
  for (int64_t r = 0; r < rows; ++r) {
    const float total = p.bias != nullptr ? totals[r] + p.bias[row + r] : totals[r];
    if (p.bf16_out)
      static_cast<c10::BFloat16*>(p.y)[xrow * p.n + row + r] = c10::BFloat16(total);
    else
      static_cast<float*>(p.y)[xrow * p.n + row + r] = total;
  }
}

template <int64_t Format>
constexpr int64_t kParts = kScalesHalves<Format> ? 2 : 1;  // integer sums a block's outputs take: per half, or whole

// An x row's float steps for one block of a group, from the block's integer sums (per part) for
// the group's eight outputs: the same whichever route gave the integers.
template <int64_t Format>
__attribute__((always_inline)) inline vfloat add_block_sums(vfloat acc, const vint (&sums)[kParts<Format>], const vfloat (&scale)[2],
                                                            const vfloat (&minimum)[2], const QuantizedRows& x, int64_t at) {
  for (int64_t part = 0; part < kParts<Format>; ++part) {
    acc = multiply_add(__builtin_convertvector(sums[part], vfloat), scale[part] * x.scale[at], acc);
    if constexpr (kOffsetShift<Format> < 0)
      acc = multiply_add(minimum[part], broadcast(kParts<Format> == 2 ? x.scaled_half_sums[2 * at + part] : x.scaled_sums[at]), acc);
  }
  return acc;
}

template <int64_t Format>
inline vint part_offset_share(const QuantizedRows& x, int64_t at, int64_t part) {
  return offset_share<Format>(kParts<Format> == 2 ? x.half_sums[2 * at + part] : x.sums[at]);
}

// Block `block` of a group against x rows [xrow, xrow + XRows), into their accumulators: the
// integer sums of all the rows in step (so the dot products of different rows overlap), then each
// row's float steps.
template <int64_t Format, int64_t XRows>
inline void add_block(const GroupBlock& g, const QuantizedRows& x, int64_t xrow, int64_t block, vfloat (&acc)[XRows]) {
  constexpr int64_t kFours = kLanes / kParts<Format>;
  vint sums[XRows][kParts<Format>];
  for (int64_t part = 0; part < kParts<Format>; ++part) {
    for (int64_t a = 0; a < XRows; ++a) sums[a][part] = part_offset_share<Format>(x, x.at(xrow + a, block), part);
    for (int64_t i = part * kFours; i < (part + 1) * kFours; ++i)
      for (int64_t a = 0; a < XRows; ++a) sums[a][part] = dot_four<Format>(sums[a][part], g.u[i], x.block_q(xrow + a, block) + 4 * i);
  }
  for (int64_t a = 0; a < XRows; ++a) acc[a] = add_block_sums<Format>(acc[a], sums[a], g.scale, g.minimum, x, x.at(xrow + a, block));
}

// Lane l: the sum of u[4l + i] * q[4l + i] for i < 4 (a row's u in the values' order against x's q): exact.
template <int64_t Format>
__attribute__((always_inline)) inline vint dot_in_order(vbytes u, vsbytes q) {
#if defined(EMBER_VNNI)
  return reinterpret_cast<vint>(_mm256_dpbusd_epi32(_mm256_setzero_si256(), reinterpret_cast<__m256i>(u), reinterpret_cast<__m256i>(q)));
#elif defined(__AVX2__)
  const __m256i x = reinterpret_cast<__m256i>(q), w = reinterpret_cast<__m256i>(u);
  const __m256i pairs = kSignedWeights<Format> ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
                                               : _mm256_maddubs_epi16(w, x);
  return reinterpret_cast<vint>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
  vint lanes{};
  for (int64_t l = 0; l < kLanes; ++l)
    for (int64_t j = 4 * l; j < 4 * l + 4; ++j) lanes[l] += static_cast<int32_t>(u[j]) * static_cast<int32_t>(q[j]);
  return lanes;
#endif
}

// Lane r of halves[h]: the sum of lanes 4h to 4h + 3 of partial[r] (its half h's sum).
__attribute__((always_inline)) inline void sum_halves(const vint (&partial)[kLanes], vint (&halves)[2]) {
#if defined(__AVX2__)
  __m256i pairs[4], quads[2];
  for (int j = 0; j < 4; ++j)
    pairs[j] = _mm256_hadd_epi32(reinterpret_cast<__m256i>(partial[2 * j]), reinterpret_cast<__m256i>(partial[2 * j + 1]));
  for (int j = 0; j < 2; ++j) quads[j] = _mm256_hadd_epi32(pairs[2 * j], pairs[2 * j + 1]);
  halves[0] = reinterpret_cast<vint>(_mm256_permute2x128_si256(quads[0], quads[1], 0x20));
  halves[1] = reinterpret_cast<vint>(_mm256_permute2x128_si256(quads[0], quads[1], 0x31));
#else
  for (int64_t r = 0; r < kLanes; ++r)
    for (int64_t h = 0; h < 2; ++h) halves[h][r] = partial[r][4 * h] + partial[r][4 * h + 1] + partial[r][4 * h + 2] + partial[r][4 * h + 3];
#endif
}

// A group of weight rows against a single x row (a one-sequence decode): each row's u stays in the
// values' order and takes one dot product against x's block, whose lanes are then summed row by row
// (no interleaving of the eight rows); the integers are add_block's, and so are the float steps.
template <int64_t Format>
void group_against_one_row(const Problem& p, int64_t row, int64_t rows) {
  constexpr BlockLayout layout = kBlockLayouts[Format];
  constexpr int64_t per_block = layout.values / kInt8BlockValues;
  const QuantizedRows& x = *p.x;
  const RowBlocks group = group_rows(p.blocks, p.row_bytes, row, rows);
  SpreadPrefetch next_group = spread_prefetch_rows(p.blocks, p.row_bytes, p.n, row + kGroupRows, kGroupRows, x.blocks);
  vfloat acc{};
  for (int64_t block = 0; block < x.blocks; ++block) {
    next_group.step();
    const RowBlocks at_block{group.first + block / per_block * layout.bytes, group.offsets};
    vsbytes q;
    std::memcpy(&q, x.block_q(0, block), sizeof(q));
    vint partial[kLanes];
#pragma GCC unroll 8
    for (int64_t r = 0; r < kLanes; ++r) {
      vbytes u = integer_values<Format>(at_block.first + at_block.offsets[r], block % per_block);
      if constexpr (kSignedWeights<Format>) u ^= 0x80;
      partial[r] = dot_in_order<Format>(u, q);
    }
    vint halves[2];
    sum_halves(partial, halves);
    vint sums[kParts<Format>];
    for (int64_t part = 0; part < kParts<Format>; ++part)
      sums[part] = part_offset_share<Format>(x, x.at(0, block), part) + (kParts<Format> == 2 ? halves[part] : halves[0] + halves[1]);
    const GroupFactors factors = group_factors<Format>(at_block, block % per_block);
    acc = add_block_sums<Format>(acc, sums, factors.scale, factors.minimum, x, x.at(0, block));
  }
  store_outputs(p, acc, 0, row, rows);
}

// The group of weight rows [row, row + rows) against x rows [xrow, xrow + XRows); group_block(block)
// gives the group's blocks, expanded as they are read or from a buffer.
template <int64_t Format, int64_t XRows, typename GroupBlocks>
inline void group_against_x_rows(const Problem& p, int64_t row, int64_t rows, int64_t xrow, const GroupBlocks& group_block) {
  vfloat acc[XRows];
  set_zero(acc);
  for (int64_t block = 0; block < p.x->blocks; ++block) {
    add_block<Format, XRows>(group_block(block), *p.x, xrow, block, acc);
  }
  for (int64_t a = 0; a < XRows; ++a) store_outputs(p, acc[a], xrow + a, row, rows);
}

#if defined(__AVX512F__)
constexpr int64_t kXRows = 8;  // x rows a group's expanded block serves from registers
#else
constexpr int64_t kXRows = 4;
#endif

template <int64_t Format, typename GroupBlocks>
inline void group_against_all_of_x(const Problem& p, int64_t row, int64_t rows, const GroupBlocks& group_block) {
  const int64_t m = p.x->m;
  int64_t xrow = 0;
  for (; xrow + kXRows <= m; xrow += kXRows) group_against_x_rows<Format, kXRows>(p, row, rows, xrow, group_block);
  if constexpr (kXRows > 4)
    for (; xrow + 4 <= m; xrow += 4) group_against_x_rows<Format, 4>(p, row, rows, xrow, group_block);
  for (; xrow + 2 <= m; xrow += 2) group_against_x_rows<Format, 2>(p, row, rows, xrow, group_block);
  for (; xrow < m; ++xrow) group_against_x_rows<Format, 1>(p, row, rows, xrow, group_block);
}

template <int64_t Format>
void int8_linear_as(const Problem& p) {
  const int64_t m = p.x->m, n = p.n, blocks = p.x->blocks, groups = (n + kGroupRows - 1) / kGroupRows;
  const auto rows_of = [&](int64_t group) { return std::min(kGroupRows, n - group * kGroupRows); };
  if (m == 1) {
    parallel_over_tiles(groups, [] { return 0; }, [&](int, int64_t begin, int64_t end) {
      for (int64_t group = begin; group < end; ++group) group_against_one_row<Format>(p, group * kGroupRows, rows_of(group));
    });
    return;
  }
  if (m <= kXRows) {  // one pass over x: each block expanded as the pass reads it
    parallel_over_tiles(groups, [] { return GroupBlock{}; }, [&](GroupBlock& g, int64_t begin, int64_t end) {
      for (int64_t group = begin; group < end; ++group) {
        const int64_t row = group * kGroupRows, rows = rows_of(group);
        SpreadPrefetch next_group = spread_prefetch_rows(p.blocks, p.row_bytes, n, row + kGroupRows, kGroupRows, blocks);
        const RowBlocks group_blocks = group_rows(p.blocks, p.row_bytes, row, rows);
        group_against_all_of_x<Format>(p, row, rows, [&](int64_t block) -> const GroupBlock& {
          next_group.step();
          expand_group<Format>(group_blocks, block, g);
          return g;
        });
      }
    });
    return;
  }
  // Several passes: the group's blocks are expanded once into a buffer that each pass reads.
  const int64_t per_take = std::clamp<int64_t>(kTilesPerTake * 16 / m, 1, kTilesPerTake);
  parallel_over_tiles(groups, [&] { return std::vector<GroupBlock>(blocks); }, [&](std::vector<GroupBlock>& expanded, int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const int64_t row = group * kGroupRows, rows = rows_of(group);
      const RowBlocks group_blocks = group_rows(p.blocks, p.row_bytes, row, rows);
      SpreadPrefetch next_group = spread_prefetch_rows(p.blocks, p.row_bytes, n, row + kGroupRows, kGroupRows, blocks);
      for (int64_t block = 0; block < blocks; ++block) {
        next_group.step();
        expand_group<Format>(group_blocks, block, expanded[block]);
      }
      group_against_all_of_x<Format>(p, row, rows, [&](int64_t block) -> const GroupBlock& { return expanded[block]; });
    }
  }, per_take);
}

void check_inputs(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias, int64_t format,
                  int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.is_cpu() && x.is_contiguous(),
              "int8_linear: x must be a contiguous float32 or bfloat16 CPU tensor [m, ", k, "], got ", x.scalar_type(),
              " ", x.sizes());
  const BlockLayout layout = block_layout(format);
  TORCH_CHECK(k > 0 && k % layout.values == 0, "int8_linear: in_features must be a positive multiple of ", layout.values,
              " in this format, got ", k);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_cpu() && blocks.is_contiguous() &&
                  blocks.size(1) == k / layout.values * layout.bytes,
              "int8_linear: blocks must be a contiguous uint8 CPU tensor [out_features, ", k / layout.values * layout.bytes,
              "], got ", blocks.scalar_type(), " ", blocks.sizes());
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == blocks.size(0) && bias->scalar_type() == x.scalar_type() &&
                    bias->is_cpu() && bias->is_contiguous(),
                "int8_linear: bias must be a contiguous CPU tensor of ", blocks.size(0), " values in x's dtype");
}

}  // namespace

namespace ember {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                       int64_t format, int64_t in_features) {
  check_inputs(x, blocks, bias, format, in_features);
  const int64_t m = x.size(0), n = blocks.size(0), k = in_features;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const QuantizedRows rows = bf16 ? quantize_rows(x.data_ptr<c10::BFloat16>(), m, k) : quantize_rows(x.data_ptr<float>(), m, k);
  at::Tensor float_bias;
  if (bias.has_value() && bias->defined()) float_bias = bias->to(at::kFloat);
  const Problem p{&rows, blocks.data_ptr<uint8_t>(), n, blocks.size(1),
                  float_bias.defined() ? float_bias.data_ptr<float>() : nullptr, y.data_ptr(), bf16};
  with_int8_block_format(format, [&](auto f) { int8_linear_as<f()>(p); });
  return y;
}

at::Tensor quantize_q8_0(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_cpu() && weight.size(1) % kInt8BlockValues == 0 &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "quantize_q8_0: weight must be a float32, bfloat16 or float16 CPU tensor [n, k] with k a multiple of 32, got ",
              weight.scalar_type(), " ", weight.sizes());
  const at::Tensor values = weight.to(at::kFloat).contiguous();
  const int64_t n = values.size(0), blocks = values.size(1) / kInt8BlockValues;
  constexpr int64_t kBytes = 2 + kInt8BlockValues;
  at::Tensor out = at::empty({n, blocks * kBytes}, weight.options().dtype(at::kByte));
  const float* in = values.data_ptr<float>();
  uint8_t* q = out.data_ptr<uint8_t>();
  at::parallel_for(0, n * blocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // ggml's quantize_row_q8_0_ref: d = max |x| / 127, q = round(x / d)
      const float* x = in + i * kInt8BlockValues;
      float largest = 0.0f;
      for (int64_t j = 0; j < kInt8BlockValues; ++j) largest = std::max(largest, std::fabs(x[j]));
      const float d = largest / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
      const uint16_t bits = c10::Half(d).x;
      std::memcpy(q + i * kBytes, &bits, sizeof(bits));
      for (int64_t j = 0; j < kInt8BlockValues; ++j) q[i * kBytes + 2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * inverse)));
    }
  });
  return out;
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("int8_linear(Tensor x, Tensor blocks, Tensor? bias, int format, int in_features) -> Tensor");
  m.def("quantize_q8_0(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("int8_linear", &ember::int8_linear);
  m.impl("quantize_q8_0", &ember::quantize_q8_0);
}
