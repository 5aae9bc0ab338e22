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
// per 256 values) that llama.cpp's K-quant kernels multiply by. On the amx build, steps of 12 rows
// or more take the integer sums from AMX tiles instead (amx_int8_linear, below), the float steps
// unchanged.
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
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
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
__attribute__((always_inline)) inline void expand_group(const RowBlocks& rows, RowFactors<Format>& row_factors, int64_t block, GroupBlock& g) {
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
  const GroupFactors factors = row_factors.at(block);
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
  RowFactors<Format> row_factors(group);
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
    const GroupFactors factors = row_factors.at(block);
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

#if defined(__AMX_INT8__)
// AMX: one tdpbusd multiplies 16 weight rows' u (unsigned, its first operand) by 16 x rows' q
// (signed) over a block's 32 values, or over a half's 16 where the format scales halves: the
// integer sums of 256 outputs in one instruction, each exactly the sum the vector routes take.
// Computed transposed, C[weight row][x row], the float steps then run per weight row with the x
// rows across a register's lanes, each output taking add_block_sums's steps in add_block_sums's
// order: the bits of the vector routes, at every row count.
constexpr int64_t kAmxRows = 16;  // weight rows of a task, x rows of a group
constexpr int64_t kAmxMinRows = 12;  // fewer x rows take the vector routes, faster where a tile would mostly idle

template <int64_t Format>
constexpr int64_t kPartValues = kInt8BlockValues / kParts<Format>;

// One block of a group of 16 x rows, as the tiles and the float steps read it; rows past m are zeros.
struct alignas(64) AmxXBlock {
  int8_t q[kInt8BlockValues / 4][4 * kAmxRows];  // tdpbusd's second operand: q[i][4 r + j] = row r's value 4 i + j
  float scale[kAmxRows];
  float scaled_sums[2][kAmxRows];  // per part: scale * sum(q), where the format has a minimum
};

// The formats with an offset take signed values w = u - offset (each fits a signed byte) through
// tdpbssd, whose sums are then sum(u q) - offset sum(q) already, the integers the vector routes
// add the offset's share to; Q8_0's are its stored bytes, read in place where a task has 16 rows.
// The formats with a minimum take u through tdpbusd.
template <int64_t Format>
constexpr bool kAmxSigned = kOffsetShift<Format> >= 0;

// One block's factors for a task's 16 weight rows; rows past n repeat the last one (their outputs
// are not stored).
struct alignas(64) AmxFactors {
  float scale[2][kAmxRows], minimum[2][kAmxRows];
};

// Where a task's values lie: row r's 32 values of block b at first + b * block_step + r * row_stride.
struct AmxValues {
  const uint8_t* first;
  int64_t block_step, row_stride;
};

// A thread's buffers for one task's weights, expanded from its blocks.
struct AmxTaskWeights {
  explicit AmxTaskWeights(int64_t blocks) : factors(blocks), values(blocks * kAmxRows * kInt8BlockValues) {}
  std::vector<AmxFactors> factors;
  std::vector<uint8_t> values;  // [blocks, 16 rows, 32]
};

template <int64_t Format>
std::vector<AmxXBlock> pack_x_for_amx(const QuantizedRows& x) {
  const int64_t groups = (x.m + kAmxRows - 1) / kAmxRows;
  std::vector<AmxXBlock> packed(groups * x.blocks);
  at::parallel_for(0, groups * x.blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // group i / blocks, block i % blocks
      const int64_t group = i / x.blocks, block = i % x.blocks;
      AmxXBlock& out = packed[i];
      std::memset(&out, 0, sizeof(out));
      for (int64_t r = 0; r < std::min(kAmxRows, x.m - group * kAmxRows); ++r) {
        const int64_t at = x.at(group * kAmxRows + r, block);
        for (int64_t four = 0; four < kInt8BlockValues / 4; ++four) std::memcpy(&out.q[four][4 * r], x.block_q(group * kAmxRows + r, block) + 4 * four, 4);
        out.scale[r] = x.scale[at];
        for (int64_t part = 0; part < kParts<Format>; ++part)
          out.scaled_sums[part][r] = kParts<Format> == 2 ? x.scaled_half_sums[2 * at + part] : x.scaled_sums[at];
      }
    }
  });
  return packed;
}

// Weight rows [row, row + rows), rows <= 16: their factors into `out`, their values too unless
// the tiles read them in place. A GGUF block at a time: each row's sub-blocks from one read of it.
template <int64_t Format>
AmxValues expand_for_amx(const Problem& p, int64_t row, int64_t rows, AmxTaskWeights& out) {
  constexpr BlockLayout layout = kBlockLayouts[Format];
  constexpr int64_t per_block = layout.values / kInt8BlockValues;
  const RowBlocks eights[2] = {group_rows(p.blocks, p.row_bytes, row, std::min(rows, kGroupRows)),
                               rows > kGroupRows ? group_rows(p.blocks, p.row_bytes, row + kGroupRows, rows - kGroupRows)
                                                 : group_rows(p.blocks, p.row_bytes, row + rows - 1, 1)};
  const bool in_place = Format == kQ8_0 && rows == kAmxRows;
  RowFactors<Format> row_factors[2] = {RowFactors<Format>(eights[0]), RowFactors<Format>(eights[1])};
  const uint8_t* sources[kAmxRows];
  for (int64_t r = 0; r < kAmxRows; ++r) sources[r] = p.blocks + (row + std::min(r, rows - 1)) * p.row_bytes;
  SpreadPrefetch next_task = spread_prefetch_rows(p.blocks, p.row_bytes, p.n, row + kAmxRows, kAmxRows, p.x->blocks);
  for (int64_t first = 0; first < p.x->blocks; first += per_block) {
    for (int64_t sub = 0; sub < per_block; ++sub) {
      next_task.step();
      for (int64_t e = 0; e < 2; ++e) {
        const GroupFactors factors = row_factors[e].at(first + sub);
        for (int64_t part = 0; part < kParts<Format>; ++part) {
          std::memcpy(&out.factors[first + sub].scale[part][kGroupRows * e], &factors.scale[part], sizeof(vfloat));
          std::memcpy(&out.factors[first + sub].minimum[part][kGroupRows * e], &factors.minimum[part], sizeof(vfloat));
        }
      }
    }
    if (in_place) continue;
    const int64_t offset = first / per_block * layout.bytes;
    uint8_t* values = out.values.data() + first * kAmxRows * kInt8BlockValues;
    for (int64_t r = 0; r < kAmxRows; ++r) {
      vbytes u[per_block];  // all of the row's sub-blocks before any store, so each byte is read once
#pragma GCC unroll 8
      for (int64_t sub = 0; sub < per_block; ++sub) {
        if constexpr (Format == kQ8_0)
          std::memcpy(&u[sub], sources[r] + offset + 2, kInt8BlockValues);  // the bytes after its float16 scale
        else if constexpr (kAmxSigned<Format>)
          u[sub] = integer_values<Format>(sources[r] + offset, sub) - static_cast<uint8_t>(1 << kOffsetShift<Format>);
        else
          u[sub] = integer_values<Format>(sources[r] + offset, sub);
      }
#pragma GCC unroll 8
      for (int64_t sub = 0; sub < per_block; ++sub) std::memcpy(values + (sub * kAmxRows + r) * kInt8BlockValues, &u[sub], sizeof(vbytes));
    }
  }
  if (in_place) return {p.blocks + row * p.row_bytes + 2, layout.bytes, p.row_bytes};
  return {out.values.data(), kAmxRows * kInt8BlockValues, kInt8BlockValues};
}

// Four sets of tiles take a task's parts (a block, or a half of one) in turn, so that while one
// part's sums are scaled, the next three parts' products run: set s sums in tile kSumTile[s] the
// u of tile 2 times the q of tile 3 (even sets) or the u of 4 times the q of 5 (odd sets).
constexpr int kSumTile[4] = {0, 1, 6, 7};
constexpr int kLookahead = 3;  // parts started before the first one's sums are read

template <int64_t Format>
TileConfig int8_tiles() {
  TileConfig config;
  for (int sum : kSumTile) config.tile(sum, kAmxRows, 4 * kAmxRows);
  for (int u : {2, 4}) config.tile(u, kAmxRows, kPartValues<Format>);
  for (int q : {3, 5}) config.tile(q, kPartValues<Format> / 4, 4 * kAmxRows);
  return config;
}

// The tile intrinsics take their tile numbers as literals.
#define EMBER_AMX_PRODUCT(sum, u, q, values, stride, x_q)                     \
  do {                                                                        \
    _tile_zero(sum);                                                          \
    _tile_loadd(u, values, stride);                                           \
    _tile_loadd(q, x_q, 4 * kAmxRows);                                        \
    if constexpr (kAmxSigned<Format>) _tile_dpbssd(sum, u, q); else _tile_dpbusd(sum, u, q); \
  } while (false)

// Starts part `part` of block `block` in tile set `Set`: its integer sums for the 256 outputs.
template <int64_t Format, int Set>
__attribute__((always_inline)) inline void start_part(const AmxValues& w, const AmxXBlock& x, int64_t block, int64_t part) {
  const uint8_t* values = w.first + block * w.block_step + part * kPartValues<Format>;
  const int8_t* q = x.q[part * kPartValues<Format> / 4];
  if constexpr (Set == 0) EMBER_AMX_PRODUCT(0, 2, 3, values, w.row_stride, q);
  if constexpr (Set == 1) EMBER_AMX_PRODUCT(1, 4, 5, values, w.row_stride, q);
  if constexpr (Set == 2) EMBER_AMX_PRODUCT(6, 2, 3, values, w.row_stride, q);
  if constexpr (Set == 3) EMBER_AMX_PRODUCT(7, 4, 5, values, w.row_stride, q);
}
#undef EMBER_AMX_PRODUCT

template <int Set>
__attribute__((always_inline)) inline void store_sums(int32_t (&sums)[kAmxRows][kAmxRows]) {
  if constexpr (Set == 0) _tile_stored(0, sums, 4 * kAmxRows);
  if constexpr (Set == 1) _tile_stored(1, sums, 4 * kAmxRows);
  if constexpr (Set == 2) _tile_stored(6, sums, 4 * kAmxRows);
  if constexpr (Set == 3) _tile_stored(7, sums, 4 * kAmxRows);
}

// A part's float steps for the 256 outputs, from its integer sums [weight row][x row].
template <int64_t Format>
__attribute__((always_inline)) inline void add_part_sums(__m512 (&acc)[kAmxRows], const int32_t (&sums)[kAmxRows][kAmxRows],
                                                         const AmxFactors& w, const AmxXBlock& x, int64_t part) {
  const __m512 x_scale = _mm512_load_ps(x.scale);
  const __m512 scaled_sums = _mm512_load_ps(x.scaled_sums[part]);
#pragma GCC unroll 16
  for (int64_t r = 0; r < kAmxRows; ++r) {
    const __m512i s = _mm512_load_si512(sums[r]);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_set1_ps(w.scale[part][r]), x_scale), acc[r]);
    if constexpr (kOffsetShift<Format> < 0) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(w.minimum[part][r]), scaled_sums, acc[r]);
  }
}

// A task's weight rows [row, row + rows) against x rows [xrow, xrow + xrows), xrows <= 16.
template <int64_t Format>
void amx_group(const Problem& p, const AmxValues& values, const AmxFactors* factors, const AmxXBlock* x, int64_t row, int64_t rows, int64_t xrow, int64_t xrows) {
  __m512 acc[kAmxRows];
  for (__m512& a : acc) a = _mm512_setzero_ps();
  alignas(64) int32_t sums[2][kAmxRows][kAmxRows];
  const int64_t parts = p.x->blocks * kParts<Format>;  // part i: part i % kParts of block i / kParts
  const auto start = [&](auto set, int64_t i) {
    if (i < parts) start_part<Format, set()>(values, x[i / kParts<Format>], i / kParts<Format>, i % kParts<Format>);
  };
  // Part i in set i % 4: its sums stored and scaled, and part i + 3 started in its place in turn.
  const auto step = [&](auto set, int64_t i) {
    start(std::integral_constant<int, (set() + kLookahead) % 4>{}, i + kLookahead);
    store_sums<set()>(sums[i % 2]);
    add_part_sums<Format>(acc, sums[i % 2], factors[i / kParts<Format>], x[i / kParts<Format>], i % kParts<Format>);
  };
  start(std::integral_constant<int, 0>{}, 0);
  start(std::integral_constant<int, 1>{}, 1);
  start(std::integral_constant<int, 2>{}, 2);
  for (int64_t i = 0; i < parts; i += 4) {
    step(std::integral_constant<int, 0>{}, i);
    if (i + 1 < parts) step(std::integral_constant<int, 1>{}, i + 1);
    if (i + 2 < parts) step(std::integral_constant<int, 2>{}, i + 2);
    if (i + 3 < parts) step(std::integral_constant<int, 3>{}, i + 3);
  }
  alignas(64) float totals[kAmxRows][kAmxRows];  // [weight row][x row]
  for (int64_t r = 0; r < kAmxRows; ++r) _mm512_store_ps(totals[r], acc[r]);
  const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 bias = p.bias != nullptr ? _mm512_maskz_loadu_ps(valid, p.bias + row) : __m512{};
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kAmxRows));
  for (int64_t j = 0; j < xrows; ++j) {  // x row j's outputs: column j, plus the bias (store_outputs's one addition)
    const __m512 sums = _mm512_i32gather_ps(column, &totals[0][j], 4);
    const __m512 total = p.bias != nullptr ? _mm512_add_ps(sums, bias) : sums;
    if (!p.bf16_out) {
      _mm512_mask_storeu_ps(static_cast<float*>(p.y) + (xrow + j) * p.n + row, valid, total);
      continue;
    }
    alignas(64) float lanes[kAmxRows];
    _mm512_store_ps(lanes, total);
    for (int64_t r = 0; r < rows; ++r) static_cast<c10::BFloat16*>(p.y)[(xrow + j) * p.n + row + r] = c10::BFloat16(lanes[r]);
  }
}

template <int64_t Format>
void amx_int8_linear(const Problem& p) {
  const int64_t m = p.x->m, n = p.n, blocks = p.x->blocks, tasks = (n + kAmxRows - 1) / kAmxRows;
  const std::vector<AmxXBlock> x = pack_x_for_amx<Format>(*p.x);
  struct Thread {  // a task's weights expanded while the previous task's run
    explicit Thread(int64_t blocks) : weights{AmxTaskWeights(blocks), AmxTaskWeights(blocks)} {}
    AmxTiles tiles{int8_tiles<Format>()};
    AmxTaskWeights weights[2];
    AmxValues values[2];
  };
  const int64_t per_take = std::clamp<int64_t>(kTilesPerTake * 8 / m, 2, kTilesPerTake);
  const auto expand = [&](Thread& thread, int64_t task) {
    const int64_t row = task * kAmxRows;
    thread.values[task % 2] = expand_for_amx<Format>(p, row, std::min(kAmxRows, n - row), thread.weights[task % 2]);
  };
  parallel_over_tiles(tasks, [&] { return Thread(blocks); }, [&](Thread& thread, int64_t begin, int64_t end) {
    expand(thread, begin);
    for (int64_t task = begin; task < end; ++task) {
      if (task + 1 < end) expand(thread, task + 1);
      const int64_t row = task * kAmxRows, rows = std::min(kAmxRows, n - row);
      for (int64_t xrow = 0; xrow < m; xrow += kAmxRows)
        amx_group<Format>(p, thread.values[task % 2], thread.weights[task % 2].factors.data(), x.data() + xrow / kAmxRows * blocks,
                          row, rows, xrow, std::min(kAmxRows, m - xrow));
    }
  }, per_take);
}
#endif

template <int64_t Format>
void int8_linear_as(const Problem& p) {
  const int64_t m = p.x->m, n = p.n, blocks = p.x->blocks, groups = (n + kGroupRows - 1) / kGroupRows;
  const auto rows_of = [&](int64_t group) { return std::min(kGroupRows, n - group * kGroupRows); };
#if defined(__AMX_INT8__)
  if (m >= kAmxMinRows && amx_permitted()) return amx_int8_linear<Format>(p);
#endif
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
        RowFactors<Format> row_factors(group_blocks);
        group_against_all_of_x<Format>(p, row, rows, [&](int64_t block) -> const GroupBlock& {
          next_group.step();
          expand_group<Format>(group_blocks, row_factors, block, g);
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
      RowFactors<Format> row_factors(group_blocks);
      for (int64_t block = 0; block < blocks; ++block) {
        next_group.step();
        expand_group<Format>(group_blocks, row_factors, block, expanded[block]);
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
