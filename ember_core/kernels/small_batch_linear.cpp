// y = x W^T + b for the few rows of a decode step (float32, CPU), reading W once, in place.
//
// At decode batch sizes the weights do not fit in any cache and every step streams all of them
// from memory, so the product is bound by memory bandwidth (batch 1) or by how well the loads
// overlap the FMAs (batch 16). BLAS sgemm repacks W on every call, which costs more than the
// product at these sizes. Here a thread takes a tile of kTileRows rows of W and, while the tile
// sits in L1, computes its dot products with every row of x, a few x rows at a time so the
// accumulators stay in registers. The weights stay in nn.Linear's [out, in] layout: no second
// copy. Larger batches (prefill) go to torch's GEMM, which is faster there.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

namespace {

constexpr int64_t kLanes = 8;  // one AVX2 register of floats
constexpr int64_t kTileRows = 4;
using vfloat = float __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sum(vfloat v) {
  float total = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

struct Problem {
  const float* x;  // [m, k]
  const float* w;  // [n, k]
  const float* bias;  // [n] or null
  float* y;  // [m, n]
  int64_t m, n, k;
};

// Rows [row, row + Rows) of W against rows [xrow, xrow + XRows) of x: Rows * XRows register accumulators.
// `next`, when set, is the next tile's first row: its Rows rows are prefetched a cache line per row
// every other step, so the next tile streams in while this one computes.
template <int64_t XRows, int64_t Rows>
inline void dot_tile(const Problem& p, int64_t xrow, int64_t row, const float* next = nullptr) {
  const int64_t k = p.k;
  const float* x = p.x + xrow * k;
  const float* w = p.w + row * k;
  vfloat acc[XRows][Rows] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    if (next != nullptr && i % (2 * kLanes) == 0)
      for (int64_t r = 0; r < Rows; ++r) __builtin_prefetch(next + r * k + i);
    vfloat xv[XRows];
    for (int64_t a = 0; a < XRows; ++a) xv[a] = load(x + a * k + i);
    for (int64_t r = 0; r < Rows; ++r) {
      const vfloat wv = load(w + r * k + i);
      for (int64_t a = 0; a < XRows; ++a) acc[a][r] += xv[a] * wv;
    }
  }
  for (int64_t a = 0; a < XRows; ++a) {
    for (int64_t r = 0; r < Rows; ++r) {
      float total = sum(acc[a][r]);
      for (int64_t j = i; j < k; ++j) total += x[a * k + j] * w[r * k + j];
      if (p.bias != nullptr) total += p.bias[row + r];
      p.y[(xrow + a) * p.n + row + r] = total;
    }
  }
}

template <int64_t Rows>
inline void rows_against_all_of_x(const Problem& p, int64_t row, const float* next) {
  // The first pass over the tile prefetches the next one.
  int64_t xrow = 0;
  for (; xrow + 3 <= p.m; xrow += 3) dot_tile<3, Rows>(p, xrow, row, std::exchange(next, nullptr));
  for (; xrow + 2 <= p.m; xrow += 2) dot_tile<2, Rows>(p, xrow, row, std::exchange(next, nullptr));
  for (; xrow < p.m; ++xrow) dot_tile<1, Rows>(p, xrow, row, std::exchange(next, nullptr));
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_batch_linear: x must be [m, k] and weight [n, k], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "small_batch_linear: supports float32 only, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.is_cpu() && weight.is_cpu() && x.is_contiguous() && weight.is_contiguous(),
              "small_batch_linear: x and weight must be contiguous CPU tensors");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == at::kFloat &&
                    bias->is_cpu() && bias->is_contiguous(),
                "small_batch_linear: bias must be a contiguous float32 CPU tensor of ", weight.size(0), " values");
  }
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{x.data_ptr<float>(), weight.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), m, n, k};
  // One x row leaves registers for twice as many weight rows: more streams in flight per thread.
  const int64_t tile_rows = m == 1 ? 2 * kTileRows : kTileRows;
  const int64_t full_tiles = n / tile_rows;
  const auto next_tile = [&](int64_t tile) { return tile + 1 < full_tiles ? p.w + (tile + 1) * tile_rows * k : nullptr; };
  at::parallel_for(0, full_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      if (m == 1)
        dot_tile<1, 2 * kTileRows>(p, 0, tile * tile_rows, next_tile(tile));
      else
        rows_against_all_of_x<kTileRows>(p, tile * tile_rows, next_tile(tile));
    }
  });
  for (int64_t row = full_tiles * tile_rows; row < n; ++row) rows_against_all_of_x<1>(p, row, nullptr);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember, m) { m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(ember, CPU, m) { m.impl("small_batch_linear", &small_batch_linear); }
