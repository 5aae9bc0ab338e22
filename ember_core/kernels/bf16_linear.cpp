// y = x W^T + b for a bfloat16 model on CPU, decode steps and prompts alike. Each output is a float32 sum
// over k whose order depends on k only, rounded to bfloat16 once with the bias: a row's bits never
// depend on the other rows of the batch (torch's bf16 GEMM picks its blocking, and so its sums, by
// the batch's shape). W is a bfloat16 weight, read in place (format BF16: its rows viewed as bytes),
// or a GGUF file's blocks, which a tile at a time expand to float32 (gguf_blocks.h) and round to
// bfloat16: the values a bfloat16 model dequantized from the file holds, for a fraction of the
// bytes a step streams from memory (Q4_1: 0.6 byte a weight against 2).
//
// Three paths, by what the build's instruction set has: AMX tiles (tdpbf16ps, 8192 multiply-adds
// an instruction), AVX512-BF16 (vdpbf16ps, 32 an instruction, float32 FMA's 16), and elsewhere
// the float32 kernel over the weight's float32 values, rounded to bfloat16 at the end.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "gguf_blocks.h"
#include "ops.h"
#include "parallel_tiles.h"
#include "vec16.h"

namespace {

constexpr int64_t kValuesPerStep = 32;  // bfloat16 values of one 512-bit register

void check_inputs(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias, int64_t format,
                  int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16 && x.is_cpu() && x.is_contiguous(),
              "bf16_linear: x must be a contiguous bfloat16 CPU tensor [m, ", k, "], got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(k > 0 && k % kValuesPerStep == 0, "bf16_linear: in_features must be a positive multiple of ",
              kValuesPerStep, ", got ", k);
  const BlockLayout layout = block_layout(format);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_cpu() && blocks.is_contiguous() &&
                  blocks.size(1) == k / layout.values * layout.bytes,
              "bf16_linear: blocks must be a contiguous uint8 CPU tensor [out_features, ",
              k / layout.values * layout.bytes, "], got ", blocks.scalar_type(), " ", blocks.sizes());
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == blocks.size(0) && bias->scalar_type() == at::kBFloat16 &&
                    bias->is_cpu() && bias->is_contiguous(),
                "bf16_linear: bias must be a contiguous bfloat16 CPU tensor of ", blocks.size(0), " values");
}

#if defined(__AVX512BF16__)
struct Problem {
  const uint16_t* x;  // [m, k] bfloat16 bits
  const c10::BFloat16* bias;  // [n] or null
  c10::BFloat16* y;  // [m, n]
  int64_t m, n, k;
};

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// The tile's outputs from sums (sixteen_sums' lane 4 (slot % 4) + slot / 4 holds slot a * Rows + r:
// x row a against weight row r), plus the bias, rounded to bfloat16 16 at a time.
template <int64_t XRows, int64_t Rows>
__attribute__((always_inline)) inline void store_tile(const Problem& p, __m512 sums, int64_t xrow, int64_t row) {
  alignas(64) static constexpr auto kIndex = [] {
    struct { int32_t lane_of_slot[16], row_of_slot[16]; } index{};
    for (int32_t slot = 0; slot < 16; ++slot) {
      index.lane_of_slot[slot] = 4 * (slot % 4) + slot / 4;
      index.row_of_slot[slot] = static_cast<int32_t>(slot % Rows);
    }
    return index;
  }();
  __m512 total = _mm512_permutexvar_ps(_mm512_load_si512(kIndex.lane_of_slot), sums);
  if (p.bias != nullptr)  // load_bf16_sixteen's lane r: bias[row + r]
    total = _mm512_add_ps(total, _mm512_permutexvar_ps(_mm512_load_si512(kIndex.row_of_slot),
                                                       load_bf16_sixteen(p.bias + row, Rows)));
  alignas(32) uint16_t rounded[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), (__m256i)_mm512_cvtneps_pbh(total));
  for (int64_t a = 0; a < XRows; ++a)
    std::memcpy(p.y + (xrow + a) * p.n + row, rounded + a * Rows, Rows * sizeof(uint16_t));
}

// Weight rows [row, row + Rows), stored at w with w_stride values between rows, against x rows
// [xrow, xrow + XRows). `next`, when set, is the next tile's first row, prefetched a line per row
// per step so it streams in while this one computes.
template <int64_t XRows, int64_t Rows>
inline void dot_tile(const Problem& p, const uint16_t* w, int64_t w_stride, int64_t xrow, int64_t row,
                     const uint16_t* next) {
  static_assert(XRows * Rows <= 16);
  __m512 acc[16];
  set_zero(acc);
  const uint16_t* x = p.x + xrow * p.k;
  for (int64_t i = 0; i < p.k; i += kValuesPerStep) {
    if (next != nullptr)
      for (int64_t r = 0; r < Rows; ++r) __builtin_prefetch(next + r * w_stride + i);
    __m512bh xv[XRows];
    for (int64_t a = 0; a < XRows; ++a) xv[a] = load_bf16(x + a * p.k + i);
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512bh wv = load_bf16(w + r * w_stride + i);
      for (int64_t a = 0; a < XRows; ++a) acc[a * Rows + r] = _mm512_dpbf16_ps(acc[a * Rows + r], xv[a], wv);
    }
  }
  store_tile<XRows, Rows>(p, sixteen_sums(acc), xrow, row);
}

constexpr int64_t kTileRows = 4;  // 4 x rows by 4 weight rows: 16 accumulators, 4 x and 1 weight register
constexpr int64_t kOneRowTileRows = 16;  // one x row leaves room for 16 weight rows

template <int64_t Rows>
inline void tile_against_x(const Problem& p, const uint16_t* w, int64_t w_stride, int64_t row, const uint16_t* next) {
  if constexpr (Rows > kTileRows) {
    TORCH_CHECK(p.m == 1, "bf16_linear: a tile of ", Rows, " weight rows takes one x row");
    dot_tile<1, Rows>(p, w, w_stride, 0, row, next);
  } else {
    int64_t xrow = 0;
    for (; xrow + 4 <= p.m; xrow += 4) dot_tile<4, Rows>(p, w, w_stride, xrow, row, std::exchange(next, nullptr));
    if (p.m - xrow == 3) dot_tile<3, Rows>(p, w, w_stride, xrow, row, next);
    if (p.m - xrow == 2) dot_tile<2, Rows>(p, w, w_stride, xrow, row, next);
    if (p.m - xrow == 1) dot_tile<1, Rows>(p, w, w_stride, xrow, row, next);
  }
}

struct Weight {
  const uint8_t* blocks;  // [n, row_bytes]
  int64_t n, row_bytes;
};

inline void store_bf16(uint16_t* out, __m512 low, __m512 high) {
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(high, low));
}

// Values [32 step, 32 step + 32) of a weight row as bfloat16, from the row's blocks: to float32
// (16 wide where the format allows), then rounded to nearest even, as torch's .to(torch.bfloat16).
template <int64_t Format>
inline void expand_step_to_bf16(const uint8_t* row_blocks, int64_t step, uint16_t* out) {
  constexpr BlockLayout layout = kBlockLayouts[Format];
  constexpr int64_t steps_per_block = layout.values / kValuesPerStep;
  const uint8_t* block = row_blocks + step / steps_per_block * layout.bytes;
  if constexpr (Format == kQ4_1) {
    // A block takes 16 values, d q + m for q < 16: round those 16 once to bfloat16 and look each
    // of the 32 nibbles up in them (vpermw), ~40% fewer instructions than widening all 32.
    const __m512 pairs = _mm512_cvtph_ps(_mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(block))));
    const __m512 levels = _mm512_fmadd_ps(_mm512_permute_ps(pairs, 0x00),
                                          _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_permute_ps(pairs, 0x55));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F))),
                                               _mm256_srli_epi16(bytes, 4), 1);
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(nibbles, _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(levels))));
  } else if constexpr (kExpandsSixteenWide<Format>) {
    const SixteenWide values = block_sixteen_wide<Format>(block);
    store_bf16(out, values.low, values.high);
  } else {
    vfloat values[kSubBlockVectors];
    expand_sub_block<Format>(block, step % steps_per_block, values);
    const auto sixteen = [&](int64_t j) {
      return _mm512_insertf32x8(_mm512_castps256_ps512(reinterpret_cast<__m256>(values[j])),
                                reinterpret_cast<__m256>(values[j + 1]), 1);
    };
    store_bf16(out, sixteen(0), sixteen(2));
  }
}

template <int64_t Format>
inline void expand_row_to_bf16(const uint8_t* row_blocks, int64_t k, uint16_t* out) {
  for (int64_t step = 0; step < k / kValuesPerStep; ++step)
    expand_step_to_bf16<Format>(row_blocks, step, out + step * kValuesPerStep);
}

// Weight rows [row, row + count) as bfloat16, k values apart: in place for BF16 rows, else
// expanded into `buffer`; rows past the weight's end are zeros.
template <int64_t Format>
const uint16_t* bf16_rows(const Weight& w, int64_t k, int64_t row, int64_t count, std::vector<uint16_t>& buffer) {
  if (Format == kBF16 && row + count <= w.n) return reinterpret_cast<const uint16_t*>(w.blocks + row * w.row_bytes);
  buffer.resize(count * k);
  for (int64_t r = 0; r < count; ++r) {
    uint16_t* out = buffer.data() + r * k;
    if (row + r >= w.n)
      std::fill(out, out + k, 0);
    else if constexpr (Format == kBF16)
      std::memcpy(out, w.blocks + (row + r) * w.row_bytes, k * sizeof(uint16_t));
    else
      expand_row_to_bf16<Format>(w.blocks + (row + r) * w.row_bytes, k, out);
  }
  return buffer.data();
}

template <int64_t Format, int64_t Rows>
void dpbf16_linear(const Problem& p, const Weight& w) {
  const int64_t k = p.k, tiles = (p.n + Rows - 1) / Rows;
  const auto buffer = [] { return std::vector<uint16_t>(); };
  // A take's work grows with m: at a prompt's 512 rows, 8 tiles are ~90 us, which the thread that
  // finishes first would wait out at the end. Fewer tiles a take there keeps the split even.
  const int64_t per_take = std::clamp<int64_t>(kTilesPerTake * 16 / p.m, 1, kTilesPerTake);
  parallel_over_tiles(tiles, buffer, [&](std::vector<uint16_t>& rows, int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t row = tile * Rows;
      if constexpr (Format != kBF16) prefetch_block_rows<2>(w.blocks, w.row_bytes, w.n, row + Rows, Rows);
      if (row + Rows > p.n) {  // the last rows, one at a time
        for (int64_t r = row; r < p.n; ++r) tile_against_x<1>(p, bf16_rows<Format>(w, k, r, 1, rows), k, r, nullptr);
        continue;
      }
      const bool in_place = Format == kBF16 && row + 2 * Rows <= p.n;
      const uint16_t* next = in_place ? reinterpret_cast<const uint16_t*>(w.blocks + (row + Rows) * w.row_bytes) : nullptr;
      tile_against_x<Rows>(p, bf16_rows<Format>(w, k, row, Rows, rows), k, row, next);
    }
  }, per_take);
}

#if defined(__AMX_BF16__)
// AMX: one tdpbf16ps multiplies a tile of 16 weight rows x 32 values by 32 values of 16 x rows,
// 8192 multiply-adds, in hardware whose sum for an output reads only its weight row and x row.
// The product is computed transposed, C[weight row][x row], so the weight tiles load in place
// (16 rows of 64 bytes at the weight's stride) and only x is repacked, into the pair-interleaved
// layout tdpbf16ps takes for its second operand: B[pair p][2 j + e] = x[j][2 p + e].
constexpr int64_t kAmxRows = 16;  // weight rows of a tile, x rows of a group
constexpr int64_t kAmxTaskRows = 4 * kAmxRows;  // weight rows of one task: tiles 0-3 accumulate them
constexpr int64_t kAmxBytes = 1024;  // one 16 x 64-byte tile

// A thread's tiles: 0-3 accumulate, 4 holds x, 5 and 6 weights, all 16 rows of 64 bytes.
TileConfig square_tiles() {
  TileConfig config;
  for (int t = 0; t < 7; ++t) config.tile(t, kAmxRows, 64);
  return config;
}

struct AmxTask {
  AmxTiles tiles{square_tiles()};
  std::vector<uint16_t> rows;  // a task's weight rows expanded from blocks, or a last task's padded
};

// x's rows, 16 at a time, as tdpbf16ps's second operand: [groups, k / 32 steps, 16 pairs, 16 rows]
// of value pairs, each step's 16 x 16 pairs the transpose of x's: one gather per pair and group,
// whose masked-off lanes zero the rows past m (so the buffer is not cleared first).
std::unique_ptr<uint32_t[]> pack_x(const Problem& p) {
  const int64_t groups = (p.m + kAmxRows - 1) / kAmxRows, pairs = p.k / 2;
  std::unique_ptr<uint32_t[]> packed(new uint32_t[groups * pairs * kAmxRows]);
  const __m512i row_offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(static_cast<int>(pairs)));
  for (int64_t group = 0; group < groups; ++group) {
    const __mmask16 rows = static_cast<__mmask16>((1u << std::min(kAmxRows, p.m - group * kAmxRows)) - 1);
    const auto* x = reinterpret_cast<const int*>(p.x) + group * kAmxRows * pairs;
    uint32_t* out = packed.get() + group * pairs * kAmxRows;
    for (int64_t pair = 0; pair < pairs; ++pair)
      _mm512_storeu_si512(out + pair * kAmxRows,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, row_offsets, x + pair, 4));
  }
  return packed;
}

// Weight rows [row, row + 64) against every x group; tile_rows(step) gives the step's 64 rows x 32
// values as (first row, bytes between rows).
template <typename TileRows>
void amx_task(const Problem& p, const uint32_t* packed_x, int64_t row, TileRows&& tile_rows) {
  const int64_t steps = p.k / kValuesPerStep;
  alignas(64) float sums[4][kAmxRows][kAmxRows];
  for (int64_t group = 0; group * kAmxRows < p.m; ++group) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* x = packed_x + group * steps * kAmxBytes / 4;
    for (int64_t step = 0; step < steps; ++step) {
      const auto [a, bytes] = tile_rows(step);
      const int64_t tile_bytes = kAmxRows * bytes;
      _tile_loadd(4, x + step * kAmxBytes / 4, 64);
      _tile_loadd(5, a, bytes);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(6, a + tile_bytes, bytes);
      _tile_dpbf16ps(1, 6, 4);
      _tile_loadd(5, a + 2 * tile_bytes, bytes);
      _tile_dpbf16ps(2, 5, 4);
      _tile_loadd(6, a + 3 * tile_bytes, bytes);
      _tile_dpbf16ps(3, 6, 4);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    // y[x row][weight row] from sums[tile][weight row][x row]: a column of 16 per gather.
    const int64_t xrows = std::min(kAmxRows, p.m - group * kAmxRows);
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(kAmxRows));
    for (int64_t t = 0; t < 4 && row + t * kAmxRows < p.n; ++t) {
      const int64_t first = row + t * kAmxRows, count = std::min(kAmxRows, p.n - first);
      const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
      __m512 bias = _mm512_setzero_ps();
      if (p.bias != nullptr)
        bias = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, reinterpret_cast<const uint16_t*>(p.bias + first))), 16));
      for (int64_t j = 0; j < xrows; ++j) {
        const __m512 total = _mm512_add_ps(_mm512_i32gather_ps(column, &sums[t][0][j], 4), bias);
        _mm256_mask_storeu_epi16(p.y + (group * kAmxRows + j) * p.n + first, valid, (__m256i)_mm512_cvtneps_pbh(total));
      }
    }
  }
}

template <int64_t Format>
void amx_linear(const Problem& p, const Weight& w) {
  const std::unique_ptr<uint32_t[]> packed_x = pack_x(p);
  const int64_t tasks = (p.n + kAmxTaskRows - 1) / kAmxTaskRows;
  const auto task_rows = [&](int64_t task) { return std::min(kAmxTaskRows, p.n - task * kAmxTaskRows); };
  if (Format == kBF16 || p.m > kAmxRows) {  // rows in place or expanded whole: several x groups reuse them
    parallel_over_tiles(tasks, [] { return AmxTask(); }, [&](AmxTask& task_state, int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task * kAmxTaskRows;
        const auto* first = reinterpret_cast<const char*>(bf16_rows<Format>(w, p.k, row, kAmxTaskRows, task_state.rows));
        amx_task(p, packed_x.get(), row, [&](int64_t step) { return std::pair(first + step * 64, p.k * 2); });
      }
    }, /* per_take = */ 1);  // a task is 64 rows: a 576-row layer has only 9
    return;
  }
  // One x group (a decode step): each step's 64 x 32 values are expanded into L1 just before their
  // tiles load, into two buffers in turn, so a step's expansion need not wait for the previous
  // step's loads. A task's blocks are one stretch of memory, read 64 rows abreast: too many streams
  // for the hardware prefetchers, so the stretch is requested by hand: a thread's first task whole,
  // and while it computes a task, a share of its next task's lines at every step.
  const int64_t steps = p.k / kValuesPerStep;
  const auto task_lines = [&](int64_t task) { return (task_rows(task) * w.row_bytes + 63) / 64; };
  const auto prefetch_lines = [&](int64_t task, int64_t from, int64_t to) {
    const uint8_t* blocks = w.blocks + task * kAmxTaskRows * w.row_bytes;
    for (int64_t line = from; line < to; ++line) __builtin_prefetch(blocks + line * 64, 0, 2);
  };
  struct Thread {
    AmxTiles tiles{square_tiles()};  // configured for the thread's tasks, released after them
    bool first_task = true;
  };
  parallel_over_tiles_looking_ahead(tasks, [] { return Thread(); }, [&](Thread& thread, int64_t task, int64_t next) {
    if (std::exchange(thread.first_task, false)) prefetch_lines(task, 0, task_lines(task));
    const int64_t row = task * kAmxTaskRows, rows = task_rows(task);
    const int64_t next_lines = next < tasks ? task_lines(next) : 0;
    const uint8_t* task_blocks = w.blocks + row * w.row_bytes;
    alignas(64) uint16_t step_rows[2][kAmxTaskRows * kValuesPerStep];
    for (uint16_t* buffer : step_rows)  // a last task's rows past n: zeros, not whatever the stack held
      std::fill(buffer + rows * kValuesPerStep, buffer + kAmxTaskRows * kValuesPerStep, uint16_t{0});
    amx_task(p, packed_x.get(), row, [&](int64_t step) {
      prefetch_lines(next, next_lines * step / steps, next_lines * (step + 1) / steps);
      uint16_t* out = step_rows[step % 2];
      for (int64_t r = 0; r < rows; ++r)
        expand_step_to_bf16<Format>(task_blocks + r * w.row_bytes, step, out + r * kValuesPerStep);
      return std::pair(reinterpret_cast<const char*>(out), int64_t{64});
    });
  });
}
#endif
#endif

}  // namespace

namespace ember {

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                       int64_t format, int64_t in_features) {
  check_inputs(x, blocks, bias, format, in_features);
#if defined(__AVX512BF16__)
  const int64_t m = x.size(0), n = blocks.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                  bias.has_value() && bias->defined() ? bias->data_ptr<c10::BFloat16>() : nullptr,
                  y.data_ptr<c10::BFloat16>(), m, n, in_features};
  const Weight w{blocks.data_ptr<uint8_t>(), n, blocks.size(1)};
  with_block_format(format, [&](auto f) {
#if defined(__AMX_BF16__)
    if (amx_permitted()) return amx_linear<f()>(p, w);
#endif
    if (m == 1) return dpbf16_linear<f(), kOneRowTileRows>(p, w);
    dpbf16_linear<f(), kTileRows>(p, w);
  });
  return y;
#else
  std::optional<at::Tensor> float_bias;
  if (bias.has_value() && bias->defined()) float_bias = bias->to(at::kFloat);
  return gguf_block_linear(x.to(at::kFloat), blocks, float_bias, format, in_features).to(at::kBFloat16);
#endif
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("bf16_linear(Tensor x, Tensor blocks, Tensor? bias, int format, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("bf16_linear", &ember::bf16_linear); }
