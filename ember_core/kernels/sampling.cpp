// The inverse-CDF draw of ember's sampler (runner/sampler.py `_draw`) in one pass and a half over
// each row, rows in parallel. torch's version converts the probabilities to float64, writes their
// whole cumulative sum and searches it: ~4 ms of a 16-row step over SmolLM2's 49152 tokens, most of
// a sampled decode step's sampling. The sums here are the same float64 additions in the same order
// (torch's CPU cumsum adds a row's values one after the other), so the tokens are the same.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

namespace ember {

at::Tensor inverse_cdf_draw(const at::Tensor& probs, const at::Tensor& uniforms) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_cpu() && probs.is_contiguous(),
              "inverse_cdf_draw: probs must be a contiguous float32 CPU tensor [rows, n], got ", probs.sizes());
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == probs.size(0) && uniforms.scalar_type() == at::kDouble &&
                  uniforms.is_cpu() && uniforms.is_contiguous(),
              "inverse_cdf_draw: uniforms must be a contiguous float64 CPU tensor of one value per row");
  const int64_t rows = probs.size(0), n = probs.size(1);
  TORCH_CHECK(n > 0, "inverse_cdf_draw: rows must not be empty");
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* chosen = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* values = p + row * n;
      double total = 0.0;
      for (int64_t i = 0; i < n; ++i) total += static_cast<double>(values[i]);
      // searchsorted (left) of u * total in the cumulative sums, clamped to the last column
      const double target = u[row] * total;
      double cumulative = 0.0;
      int64_t i = 0;
      for (; i < n - 1; ++i) {
        cumulative += static_cast<double>(values[i]);
        if (cumulative >= target) break;
      }
      chosen[row] = i;
    }
  });
  return out;
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) { m.def("inverse_cdf_draw(Tensor probs, Tensor uniforms) -> Tensor"); }

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("inverse_cdf_draw", &ember::inverse_cdf_draw); }
