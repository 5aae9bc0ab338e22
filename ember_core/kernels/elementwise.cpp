// The per-token ops between a decoder layer's matmuls, as single C++ calls (float32 or bfloat16, CPU):
// RMSNorm (of rows, or in place of each head's vector: q/k norms), rotary embeddings, and the gated
// activations (SwiGLU, GeGLU). Eager torch dispatches several ops for each (F.rms_norm about ten),
// which at decode batch sizes costs far more than the arithmetic.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_cpu(), op, ": ", name, " must be a float32 or bfloat16 CPU tensor, got ",
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

// One vector of dim values normalised into out (which may be x itself): out = w * (x * scale) with
// scale = 1 / sqrt(mean(x^2) + eps), the mean in double.
void normalise(const float* x, const float* w, float* out, int64_t dim, double eps) {
  const float scale = static_cast<float>(1.0 / std::sqrt(sum_of_squares(x, dim) / dim + eps));
  for (int64_t i = 0; i < dim; ++i) out[i] = w[i] * (x[i] * scale);
}

// The bfloat16 ops: each value widened to float32, computed as the float32 op does, rounded back
// once, a vector of 8 at a time (a row's tail in a partial one). The normalised vector is rounded
// to bfloat16 before the weight, as transformers' Llama does. `row` is scratch of dim floats
// rounded up to whole vectors.
void normalise_bf16(const BFloat16* x, const BFloat16* w, BFloat16* out, int64_t dim, double eps, float* row) {
  BFloat16 normalised[kLanes];
  for (int64_t i = 0; i < dim; i += kLanes) store(row + i, load_bf16_first(x + i, std::min(kLanes, dim - i)));
  const float scale = static_cast<float>(1.0 / std::sqrt(sum_of_squares(row, dim) / dim + eps));
  for (int64_t i = 0; i < dim; i += kLanes) {
    const int64_t count = std::min(kLanes, dim - i);
    store_bf16(normalised, load(row + i) * scale);
    store_bf16_first(out + i, load_bf16_first(w + i, count) * load_bf16(normalised), count);
  }
}

// Each of x's [rows, groups] vectors of dim values (rows and groups may be strided; the vectors are
// contiguous) normalised into the same place of y, which may be x.
template <typename T>
void normalise_all(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y, double eps) {
  const int64_t rows = x.size(0), groups = x.size(1), dim = x.size(2);
  const T* in = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* out = y.data_ptr<T>();
  at::parallel_for(0, rows * groups, rows_per_task(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> row(std::is_same_v<T, BFloat16> ? (dim + kLanes - 1) / kLanes * kLanes : 0);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t r = index / groups, g = index % groups;
      const T* vector_in = in + r * x.stride(0) + g * x.stride(1);
      T* vector_out = out + r * y.stride(0) + g * y.stride(1);
      if constexpr (std::is_same_v<T, BFloat16>)
        normalise_bf16(vector_in, w, vector_out, dim, eps, row.data());
      else
        normalise(vector_in, w, vector_out, dim, eps);
    }
  });
}

void check_norm_operands(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && weight.dim() == 1 && weight.size(0) == x.size(2) &&
                  weight.is_contiguous() && x.is_cpu() && weight.scalar_type() == x.scalar_type(),
              op, ": x must be [rows, groups, ", weight.size(0), "] with contiguous vectors, and the weight a contiguous "
              "vector of x's dtype, got ", x.sizes(), " strides ", x.strides(), " and a ", weight.scalar_type(), " weight");
  if (!is_bf16(x)) check_float_cpu(x, op, "x");
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
          const int64_t n = std::min(kLanes, half - i);
          const vfloat first = load_bf16_first(v + i, n), second = load_bf16_first(v + i + half, n);
          store_bf16_first(v + i, first * load_bf16_first(ct + i, n) - second * load_bf16_first(st + i, n), n);
          store_bf16_first(v + i + half,
                           second * load_bf16_first(ct + i + half, n) + first * load_bf16_first(st + i + half, n), n);
        }
      }
  });
}

// The gated activations of the MLP's fused gate/up output: act(gate) * up, as vector code.
struct Silu {
  vfloat operator()(vfloat g) const { return g * sigmoid_vector(g); }
};

// GELU's tanh approximation (gelu_pytorch_tanh, Gemma's GeGLU), in torch's order of operations.
struct GeluTanh {
  vfloat operator()(vfloat x) const {
    constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kKappa = 0.044715f;
    const vfloat cube = x * x * x;
    return 0.5f * x * (1.0f + tanh_vector(kBeta * (x + kKappa * cube)));
  }
};

template <typename T, typename Activation>
at::Tensor gated(const at::Tensor& gate_up, Activation activation) {
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const T* in = gate_up.data_ptr<T>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, rows, rows_per_task(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * n;
      const T* up = gate + n;
      T* row = y + r * n;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, BFloat16>) {
        for (; i < n; i += kLanes) {
          const int64_t count = std::min(kLanes, n - i);
          store_bf16_first(row + i, activation(load_bf16_first(gate + i, count)) * load_bf16_first(up + i, count), count);
        }
      } else {
        for (; i + kLanes <= n; i += kLanes) store(row + i, activation(load(gate + i)) * load(up + i));
        for (; i < n; ++i) row[i] = activation(broadcast(gate[i]))[0] * up[i];
      }
    }
  });
  return out;
}

// act(gate) * up for gate_up = [gate | up] along each row.
template <typename Activation>
at::Tensor gated_activation(const at::Tensor& gate_up, const char* op, Activation activation) {
  if (is_bf16(gate_up) && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0)
    return gated<BFloat16>(gate_up, activation);
  check_float_cpu(gate_up, op, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, op,
              ": gate_up must be a contiguous [rows, 2 * n] tensor, got ", gate_up.sizes());
  return gated<float>(gate_up, activation);
}

// y = x * sigmoid(gate), element by element (a gated attention's output); a row's tail gets the vector
// arithmetic too, so every element's bits are the same wherever it sits.
template <typename T>
at::Tensor sigmoid_gated(const at::Tensor& x, const at::Tensor& gate) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xs = x.data_ptr<T>();
  const T* gs = gate.data_ptr<T>();
  T* ys = out.data_ptr<T>();
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < n; i += kLanes) {
        const int64_t count = std::min(kLanes, n - i), at = r * n + i;
        if constexpr (std::is_same_v<T, BFloat16>) {
          store_bf16_first(ys + at, load_bf16_first(xs + at, count) * sigmoid_vector(load_bf16_first(gs + at, count)), count);
        } else {
          float lanes_x[kLanes] = {}, lanes_g[kLanes] = {}, lanes_y[kLanes];
          std::memcpy(lanes_x, xs + at, count * sizeof(float));
          std::memcpy(lanes_g, gs + at, count * sizeof(float));
          store(lanes_y, load(lanes_x) * sigmoid_vector(load(lanes_g)));
          std::memcpy(ys + at, lanes_y, count * sizeof(float));
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace ember {

// y = x / sqrt(mean(x^2) + eps) * weight, row by row; the mean in double.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (is_bf16(x) && is_bf16(weight) && x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
      weight.size(0) == x.size(1)) {
    at::Tensor y = at::empty(x.sizes(), x.options());
    normalise_all<BFloat16>(x.unsqueeze(1), weight, y.unsqueeze(1), eps);
    return y;
  }
  check_float_cpu(x, "rms_norm", "x");
  check_float_cpu(weight, "rms_norm", "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              "rms_norm: x must be a contiguous [rows, ", weight.size(0), "] tensor, got ", x.sizes());
  at::Tensor y = at::empty(x.sizes(), x.options());
  normalise_all<float>(x.unsqueeze(1), weight, y.unsqueeze(1), eps);
  return y;
}

// rms_norm of each of x's [rows, groups] vectors in place: the q/k norms of a fused QKV output's
// q or k columns, per head (Qwen 3, Gemma 3: groups = heads) or over the whole projection (OLMo 2:
// one group). x may be a strided view; the vectors must be contiguous.
void rms_norm_(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_operands(x, weight, "rms_norm_");
  if (is_bf16(x))
    normalise_all<BFloat16>(x, weight, x, eps);
  else
    normalise_all<float>(x, weight, x, eps);
}

// Rotary embedding in Hugging Face's rotate_half layout, into x itself: for i < half,
// (x_i, x_{i+half}) -> (x_i cos_i - x_{i+half} sin_i, x_{i+half} cos_{i+half} + x_i sin_{i+half}).
// x [tokens, heads, head_dim] may be a strided view (the q/k columns of the fused QKV output).
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (is_bf16(x) && is_bf16(cos) && is_bf16(sin) && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 &&
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

at::Tensor silu_and_mul(const at::Tensor& gate_up) { return gated_activation(gate_up, "silu_and_mul", Silu{}); }

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  return gated_activation(gate_up, "gelu_tanh_and_mul", GeluTanh{});
}

at::Tensor sigmoid_mul(const at::Tensor& x, const at::Tensor& gate) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && gate.is_contiguous() && x.sizes() == gate.sizes() &&
                  x.scalar_type() == gate.scalar_type(),
              "sigmoid_mul: x and gate must be contiguous [rows, n] tensors of one shape and dtype");
  if (is_bf16(x)) return sigmoid_gated<BFloat16>(x, gate);
  check_float_cpu(x, "sigmoid_mul", "x");
  return sigmoid_gated<float>(x, gate);
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("rms_norm_(Tensor(a!) x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.def("sigmoid_mul(Tensor x, Tensor gate) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("rms_norm", &ember::rms_norm);
  m.impl("rotary_", &ember::rotary_);
  m.impl("rms_norm_", &ember::rms_norm_);
  m.impl("silu_and_mul", &ember::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &ember::gelu_tanh_and_mul);
  m.impl("sigmoid_mul", &ember::sigmoid_mul);
}
