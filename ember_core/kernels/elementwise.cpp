// The per-token ops between a Llama layer's matmuls, as single C++ calls (float32 or bfloat16, CPU): eager
// torch dispatches several ops for each (F.rms_norm about ten), which at decode batch sizes costs
// far more than the arithmetic.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec8.h"

// torch's rotary (x * cos + rotate_half(x) * sin) rounds each product before the sum; fusing them
// into FMAs would change the last bit, so this file writes no multiply_add (the build's
// -ffp-contract=off keeps the compiler from fusing them either).

namespace {

// Rows of `width` values per parallel task: ~8K values, so a decode step's 16 rows of a 1536-wide
// gate split across two cores.
inline int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(width, 1)); }

void check_float_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_cpu(), op, ": ", name, " must be a float32 CPU tensor (or bfloat16, in rows of a multiple of 8 values), got ",
              t.scalar_type(), " on ", t.device());
}

using vdouble4 = double __attribute__((vector_size(4 * sizeof(double))));
using vfloat4 = float __attribute__((vector_size(4 * sizeof(float))));

// Sum of x[i]^2 in double: four independent vector sums, so the adds do not wait on each other.
double sum_of_squares(const float* x, int64_t n) {
  vdouble4 partial[4] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int64_t j = 0; j < 4; ++j) {
      vfloat4 v;
      std::memcpy(&v, x + i + 4 * j, sizeof(v));
      const vdouble4 d = __builtin_convertvector(v, vdouble4);
      partial[j] += d * d;
    }
  }
  const vdouble4 total4 = (partial[0] + partial[1]) + (partial[2] + partial[3]);
  double total = (total4[0] + total4[1]) + (total4[2] + total4[3]);
  for (; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  return total;
}

using c10::BFloat16;

bool is_bf16(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16; }

// The bfloat16 ops: each value widened to float32, computed as the float32 op does, rounded back
// once. The normalised row is rounded to bfloat16 before the weight, as transformers' Llama does.
// Dimensions are multiples of 8 (checked by the callers below).
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  at::Tensor y = at::empty(x.sizes(), x.options());
  const BFloat16* in = x.data_ptr<BFloat16>();
  const BFloat16* w = weight.data_ptr<BFloat16>();
  BFloat16* out = y.data_ptr<BFloat16>();
  at::parallel_for(0, rows, rows_per_task(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    std::vector<BFloat16> normalised(kLanes);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < dim; i += kLanes) store(row.data() + i, load_bf16(in + r * dim + i));
      const float scale = static_cast<float>(1.0 / std::sqrt(sum_of_squares(row.data(), dim) / dim + eps));
      for (int64_t i = 0; i < dim; i += kLanes) {
        store_bf16(normalised.data(), load(row.data() + i) * scale);
        store_bf16(out + r * dim + i, load_bf16(w + i) * load_bf16(normalised.data()));
      }
    }
  });
  return y;
}

void rotary_bf16_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  BFloat16* data = x.data_ptr<BFloat16>();
  const BFloat16* c = cos.data_ptr<BFloat16>();
  const BFloat16* s = sin.data_ptr<BFloat16>();
  at::parallel_for(0, tokens, rows_per_task(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        BFloat16* v = data + t * x.stride(0) + h * x.stride(1);
        const BFloat16 *ct = c + t * dim, *st = s + t * dim;
        for (int64_t i = 0; i < half; i += kLanes) {
          const vfloat first = load_bf16(v + i), second = load_bf16(v + i + half);
          store_bf16(v + i, first * load_bf16(ct + i) - second * load_bf16(st + i));
          store_bf16(v + i + half, second * load_bf16(ct + i + half) + first * load_bf16(st + i + half));
        }
      }
  });
}

at::Tensor silu_and_mul_bf16(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const BFloat16* in = gate_up.data_ptr<BFloat16>();
  BFloat16* y = out.data_ptr<BFloat16>();
  at::parallel_for(0, rows, rows_per_task(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < n; i += kLanes) {
        const vfloat g = load_bf16(in + r * 2 * n + i);
        const vfloat e = exp_nonpositive(g < 0.0f ? g : -g);
        store_bf16(y + r * n + i, g * ((g < 0.0f ? e : broadcast(1.0f)) / (1.0f + e)) * load_bf16(in + r * 2 * n + n + i));
      }
  });
  return out;
}

}  // namespace

namespace ember {

// y = x / sqrt(mean(x^2) + eps) * weight, row by row; the mean in double.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (is_bf16(x) && is_bf16(weight) && x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
      weight.size(0) == x.size(1) && x.size(1) % kLanes == 0)
    return rms_norm_bf16(x, weight, eps);
  check_float_cpu(x, "rms_norm", "x");
  check_float_cpu(weight, "rms_norm", "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              "rms_norm: x must be a contiguous [rows, ", weight.size(0), "] tensor, got ", x.sizes());
  const int64_t rows = x.size(0), dim = x.size(1);
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * dim;
      const float scale = static_cast<float>(1.0 / std::sqrt(sum_of_squares(row, dim) / dim + eps));
      for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = w[i] * (row[i] * scale);
    }
  });
  return y;
}

// Rotary embedding in Hugging Face's rotate_half layout, into x itself: for i < half,
// (x_i, x_{i+half}) -> (x_i cos_i - x_{i+half} sin_i, x_{i+half} cos_{i+half} + x_i sin_{i+half}).
// x [tokens, heads, head_dim] may be a strided view (the q/k columns of the fused QKV output).
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (is_bf16(x) && is_bf16(cos) && is_bf16(sin) && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % (2 * kLanes) == 0 &&
      cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
      cos.is_contiguous() && sin.is_contiguous())
    return rotary_bf16_(x, cos, sin);
  check_float_cpu(x, "rotary_", "x");
  check_float_cpu(cos, "rotary_", "cos");
  check_float_cpu(sin, "rotary_", "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary_: x must be [tokens, heads, head_dim] ",
              "with contiguous, even head_dim, got ", x.sizes(), " strides ", x.strides());
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == dim &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary_: cos and sin must be contiguous [", tokens, ", ", dim, "], got ", cos.sizes(), " and ", sin.sizes());
  float* data = x.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, tokens, rows_per_task(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * dim;
      const float* st = s + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = data + t * token_stride + h * head_stride;
        int64_t i = 0;
        for (; i + kLanes <= half; i += kLanes) {
          const vfloat first = load(v + i), second = load(v + i + half);
          store(v + i, first * load(ct + i) - second * load(st + i));
          store(v + i + half, second * load(ct + i + half) + first * load(st + i + half));
        }
        for (; i < half; ++i) {
          const float first = v[i], second = v[i + half];
          v[i] = first * ct[i] - second * st[i];
          v[i + half] = second * ct[i + half] + first * st[i + half];
        }
      }
    }
  });
}

// silu(gate) * up for gate_up = [gate | up] along each row (the fused gate/up projection's output).
// sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below, so nothing overflows.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  if (is_bf16(gate_up) && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % (2 * kLanes) == 0)
    return silu_and_mul_bf16(gate_up);
  check_float_cpu(gate_up, "silu_and_mul", "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be a contiguous [rows, 2 * n] tensor, got ", gate_up.sizes());
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * n;
      const float* up = gate + n;
      float* row = y + r * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        const vfloat g = load(gate + i);
        const vfloat e = exp_nonpositive(g < 0.0f ? g : -g);
        store(row + i, g * ((g < 0.0f ? e : broadcast(1.0f)) / (1.0f + e)) * load(up + i));
      }
      for (; i < n; ++i) {
        const float g = gate[i], e = std::exp(-std::fabs(g));
        row[i] = g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * up[i];
      }
    }
  });
  return out;
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("rms_norm", &ember::rms_norm);
  m.impl("rotary_", &ember::rotary_);
  m.impl("silu_and_mul", &ember::silu_and_mul);
}
