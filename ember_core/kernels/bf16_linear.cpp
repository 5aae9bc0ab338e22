// y = x W^T + b in bfloat16 for the few rows of a decode step (CPU). Each output is a float32 sum
// over k whose order depends on k only, rounded to bfloat16 once with the bias: a row's bits never
// depend on the other rows of the batch (torch's bf16 GEMM picks its blocking, and so its sums, by
// the batch's shape). The weight is read in place.
//
// Three paths, by what the build's instruction set has: AMX tiles (tdpbf16ps, 8192 multiply-adds
// an instruction), AVX512-BF16 (vdpbf16ps, 32 an instruction, float32 FMA's 16), and elsewhere
// the float32 kernel over the weight's rows widened to float32.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "gguf_blocks.h"
#include "ops.h"
#include "parallel_tiles.h"

namespace {

constexpr int64_t kValuesPerStep = 32;  // bfloat16 values of one 512-bit register

void check_inputs(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_cpu() && weight.is_contiguous(),
              "bf16_linear: weight must be a contiguous bfloat16 CPU tensor [n, k], got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t k = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16 && x.is_cpu() && x.is_contiguous(),
              "bf16_linear: x must be a contiguous bfloat16 CPU tensor [m, ", k, "], got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(k > 0 && k % kValuesPerStep == 0, "bf16_linear: in_features must be a positive multiple of ",
              kValuesPerStep, ", got ", k);
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == at::kBFloat16 &&
                    bias->is_cpu() && bias->is_contiguous(),
                "bf16_linear: bias must be a contiguous bfloat16 CPU tensor of ", weight.size(0), " values");
}

#if defined(__AVX512BF16__)
struct Problem {
  const uint16_t* x;  // [m, k] bfloat16 bits
  const c10::BFloat16* bias;  // [n] or null
  c10::BFloat16* y;  // [m, n]
  int64_t m, n, k;
};

// Lane 4c + l of the result: the sum of acc[4l + c]'s 16 lanes. Every accumulator's lanes are added
// in the same tree (j + 8, then j + 4, then (0 + 2) + (1 + 3)), whichever slot it takes, so an
// output's bits do not depend on the tile around it; 16 sums cost ~30 instructions, not ~16 x 8.
inline __m512 sixteen_sums(const __m512 (&acc)[16]) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int t = 0; t < 8; ++t) {  // [acc[2t] lanes j + (j + 8) | acc[2t + 1] lanes j + (j + 8)], j < 8
    const __m512 low = _mm512_shuffle_f32x4(acc[2 * t], acc[2 * t + 1], 0x44);
    const __m512 high = _mm512_shuffle_f32x4(acc[2 * t], acc[2 * t + 1], 0xEE);
    halves[t] = _mm512_add_ps(low, high);
  }
  for (int t = 0; t < 4; ++t)  // 128-bit chunk c: acc[4t + c] lanes j + (j + 4), j < 4
    quarters[t] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * t], halves[2 * t + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * t], halves[2 * t + 1], 0xDD));
  for (int t = 0; t < 2; ++t)  // chunk c: [q(0 + 2), q(1 + 3)] of quarters[2t] then of quarters[2t + 1]
    pairs[t] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * t], quarters[2 * t + 1], 0x44),
                             _mm512_shuffle_ps(quarters[2 * t], quarters[2 * t + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
}

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Weight rows [row, row + Rows), stored at w with w_stride values between rows, against x rows
// [xrow, xrow + XRows). `next`, when set, is the next tile's first row, prefetched a line per row
// per step so it streams in while this one computes.
template <int64_t XRows, int64_t Rows>
inline void dot_tile(const Problem& p, const uint16_t* w, int64_t w_stride, int64_t xrow, int64_t row,
                     const uint16_t* next) {
  static_assert(XRows * Rows <= 16);
  __m512 acc[16];
  for (__m512& a : acc) a = _mm512_setzero_ps();
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
  float sums[16];
  _mm512_storeu_ps(sums, sixteen_sums(acc));
  for (int64_t a = 0; a < XRows; ++a)
    for (int64_t r = 0; r < Rows; ++r) {
      const int64_t slot = a * Rows + r;
      float total = sums[4 * (slot % 4) + slot / 4];
      if (p.bias != nullptr) total += static_cast<float>(p.bias[row + r]);
      p.y[(xrow + a) * p.n + row + r] = c10::BFloat16(total);
    }
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

template <int64_t Rows>
void dpbf16_linear(const Problem& p, const uint16_t* w) {
  const int64_t k = p.k, full_tiles = p.n / Rows;
  parallel_over_tiles(full_tiles, [] { return 0; }, [&](int /* no state */, int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const uint16_t* next = tile + 1 < full_tiles ? w + (tile + 1) * Rows * k : nullptr;
      tile_against_x<Rows>(p, w + tile * Rows * k, k, tile * Rows, next);
    }
  });
  for (int64_t row = full_tiles * Rows; row < p.n; ++row) tile_against_x<1>(p, w + row * k, k, row, nullptr);
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

bool amx_permitted() {
  // Linux hands out AMX's 8 KB of tile state per process on request (XFEATURE_XTILEDATA = 18).
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// A thread's tiles: 0-3 accumulate, 4 holds x, 5 and 6 weights, all 16 rows of 64 bytes; released
// when the thread's share of the work ends.
struct AmxTiles {
  std::vector<uint16_t> rows;  // a last task's weight rows, padded to a whole task
  AmxTiles() {
    TileConfig config;
    for (int t = 0; t < 7; ++t) config.bytes_per_row[t] = 64, config.rows[t] = kAmxRows;
    _tile_loadconfig(&config);
  }
  ~AmxTiles() { _tile_release(); }
};

// x's rows, 16 at a time, as tdpbf16ps's second operand: [groups, k / 32 steps, 16 pairs, 16 rows]
// of value pairs, each step's 16 x 16 pairs the transpose of x's.
std::vector<uint32_t> pack_x(const Problem& p) {
  const int64_t groups = (p.m + kAmxRows - 1) / kAmxRows, steps = p.k / kValuesPerStep, pairs = p.k / 2;
  std::vector<uint32_t> packed(groups * steps * kAmxBytes / 4, 0);
  const auto* x = reinterpret_cast<const uint32_t*>(p.x);
  for (int64_t row = 0; row < p.m; ++row) {
    uint32_t* out = packed.data() + (row / kAmxRows) * steps * kAmxBytes / 4 + row % kAmxRows;
    for (int64_t pair = 0; pair < pairs; ++pair) out[pair * kAmxRows] = x[row * pairs + pair];
  }
  return packed;
}

// Weight rows [row, row + 64) at w (stride values apart) against every x group.
void amx_task(const Problem& p, const uint16_t* w, int64_t stride, const uint32_t* packed_x, int64_t row) {
  const int64_t steps = p.k / kValuesPerStep, bytes = stride * 2;
  alignas(64) float sums[4][kAmxRows][kAmxRows];
  for (int64_t group = 0; group * kAmxRows < p.m; ++group) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* x = packed_x + group * steps * kAmxBytes / 4;
    for (int64_t step = 0; step < steps; ++step) {
      const uint16_t* a = w + step * kValuesPerStep;
      _tile_loadd(4, x + step * kAmxBytes / 4, 64);
      _tile_loadd(5, a, bytes);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(6, a + kAmxRows * stride, bytes);
      _tile_dpbf16ps(1, 6, 4);
      _tile_loadd(5, a + 2 * kAmxRows * stride, bytes);
      _tile_dpbf16ps(2, 5, 4);
      _tile_loadd(6, a + 3 * kAmxRows * stride, bytes);
      _tile_dpbf16ps(3, 6, 4);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    const int64_t xrows = std::min(kAmxRows, p.m - group * kAmxRows), wrows = std::min(kAmxTaskRows, p.n - row);
    for (int64_t j = 0; j < xrows; ++j)
      for (int64_t r = 0; r < wrows; ++r) {
        float total = sums[r / kAmxRows][r % kAmxRows][j];
        if (p.bias != nullptr) total += static_cast<float>(p.bias[row + r]);
        p.y[(group * kAmxRows + j) * p.n + row + r] = c10::BFloat16(total);
      }
  }
}

void amx_linear(const Problem& p, const uint16_t* w) {
  const std::vector<uint32_t> packed_x = pack_x(p);
  const int64_t k = p.k, tasks = (p.n + kAmxTaskRows - 1) / kAmxTaskRows;
  parallel_over_tiles(tasks, [] { return AmxTiles(); }, [&](AmxTiles& tiles, int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task * kAmxTaskRows, rows = std::min(kAmxTaskRows, p.n - row);
      if (rows == kAmxTaskRows) {
        amx_task(p, w + row * k, k, packed_x.data(), row);
        continue;
      }
      tiles.rows.assign(kAmxTaskRows * k, 0);  // the last task's rows, padded with zero rows
      std::memcpy(tiles.rows.data(), w + row * k, rows * k * sizeof(uint16_t));
      amx_task(p, tiles.rows.data(), k, packed_x.data(), row);
    }
  });
}
#endif
#endif

}  // namespace

namespace ember {

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_inputs(x, weight, bias);
#if defined(__AVX512BF16__)
  const int64_t m = x.size(0), n = weight.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                  bias.has_value() && bias->defined() ? bias->data_ptr<c10::BFloat16>() : nullptr,
                  y.data_ptr<c10::BFloat16>(), m, n, weight.size(1)};
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
#if defined(__AMX_BF16__)
  if (amx_permitted()) {
    amx_linear(p, w);
    return y;
  }
#endif
  if (m == 1)
    dpbf16_linear<kOneRowTileRows>(p, w);
  else
    dpbf16_linear<kTileRows>(p, w);
  return y;
#else
  // The weight's rows are GGUF BF16 rows to the float32 kernel, which widens them tile by tile.
  std::optional<at::Tensor> float_bias;
  if (bias.has_value() && bias->defined()) float_bias = bias->to(at::kFloat);
  return gguf_block_linear(x.to(at::kFloat), weight.view(at::kByte), float_bias, kBF16, weight.size(1))
      .to(at::kBFloat16);
#endif
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("bf16_linear", &ember::bf16_linear); }
