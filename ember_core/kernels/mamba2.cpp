// Granite 4.0-H's Mamba2 (SSD) mixer between its input and output projections (layers/mamba2.py),
// for the prompt chunks and decodes of one step: the causal convolution over x, B and C with SiLU,
// the selective state-space recurrence per head, D's skip, and the RMSNorm gated by silu(z) per group.
//
// Per head h (of group g) and token: dt = softplus(dt_raw + dt_bias) clamped to the time-step limits,
// then for each of its state_size entries n and head_dim channels p (S is kept [state, head_dim])
//     S[n][p] = S[n][p] * exp(dt * A) + (dt * B[g][n]) * x[p];   y[p] = sum_n S[n][p] * C[g][n] + D * x[p]
// with A = -exp(A_log). The recurrence runs token by token in prompts as in decodes (never the
// chunked SSD form transformers uses for prompts), so a token's bits never depend on how its prompt
// was chunked or batched; work splits only along (sequence, head) and (token, group).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "causal_conv.h"
#include "ops.h"

namespace {

using c10::BFloat16;
using ember::recurrent::as_model;
using ember::recurrent::Batch;
using ember::recurrent::sigmoid;
using ember::recurrent::softplus;

struct Sizes {
  int64_t heads, head_dim, state, groups, kernel;
  double time_step_min, time_step_max;
  int64_t inner() const { return heads * head_dim; }
  int64_t conv_size() const { return inner() + 2 * groups * state; }
  // projected's row: [z | x B C | dt]
  int64_t row() const { return inner() + conv_size() + heads; }
};

// y [tokens, inner] in float32: the recurrence per (sequence, head), token by token.
template <typename T>
void scan(const T* projected, const float* convolved, const T* a_log, const T* dt_bias, const T* d_skip,
          float* ssm_state, float* y, const Sizes& s, const Batch& b) {
  const int64_t heads = s.heads, hd = s.head_dim, n = s.state, channels = s.conv_size(), row = s.row();
  const int64_t heads_per_group = heads / s.groups;
  const float low = static_cast<float>(s.time_step_min), high = static_cast<float>(s.time_step_max);
  at::parallel_for(0, b.sequences * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> dt_b(n);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / heads, h = item % heads, g = h / heads_per_group;
      const int64_t start = b.starts[seq], count = b.starts[seq + 1] - start;
      float* state = ssm_state + (b.slots[seq] * heads + h) * n * hd;
      if (b.fresh[seq])
        for (int64_t i = 0; i < hd * n; ++i) state[i] = 0.0f;
      const float rate = -std::exp(static_cast<float>(a_log[h]));
      const float skip = static_cast<float>(d_skip[h]);
      for (int64_t t = 0; t < count; ++t) {
        const int64_t token = start + t;
        const float raw = static_cast<float>(projected[token * row + s.inner() + channels + h]);
        float dt = as_model<T>(softplus(as_model<T>(raw + static_cast<float>(dt_bias[h]))));
        dt = std::min(std::max(dt, low), high);
        const float decay = std::exp(dt * rate);
        const float* x = convolved + token * channels + h * hd;
        const float* bias_in = convolved + token * channels + s.inner() + g * n;
        const float* read_out = convolved + token * channels + s.inner() + s.groups * n + g * n;
        for (int64_t i = 0; i < n; ++i) dt_b[i] = dt * bias_in[i];
        // S is kept [state, head_dim]: each of its rows updates and adds into all of y's channels in
        // vectors, each channel's sum still taken over the state in order.
        const float* __restrict__ xs = x;
        float* __restrict__ out = y + token * s.inner() + h * hd;
        for (int64_t p = 0; p < hd; ++p) out[p] = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          float* __restrict__ state_row = state + i * hd;
          const float update = dt_b[i], read = read_out[i];
          for (int64_t p = 0; p < hd; ++p) {
            state_row[p] = state_row[p] * decay + update * xs[p];
            out[p] += state_row[p] * read;
          }
        }
        for (int64_t p = 0; p < hd; ++p) out[p] += skip * xs[p];
      }
    }
  });
}

// out = weight * rmsnorm(y * silu(z)) over each group's channels, in float32 (transformers' gated
// norm with norm_before_gate off), rounded once to the model's dtype.
template <typename T>
void gated_norm(const T* projected, const float* y, const T* norm_weight, double eps, T* out, const Sizes& s,
                int64_t tokens) {
  const int64_t inner = s.inner(), group_size = inner / s.groups, row = s.row();
  at::parallel_for(0, tokens * s.groups, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gated(group_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t token = item / s.groups, first = (item % s.groups) * group_size;
      const T* z = projected + token * row + first;
      const float* values = y + token * inner + first;
      float total = 0.0f;
      for (int64_t j = 0; j < group_size; ++j) {
        const float gate = static_cast<float>(z[j]);
        gated[j] = as_model<T>(values[j]) * (gate * sigmoid(gate));
        total += gated[j] * gated[j];
      }
      const float inverse = 1.0f / std::sqrt(total / static_cast<float>(group_size) + static_cast<float>(eps));
      T* o = out + token * inner + first;
      for (int64_t j = 0; j < group_size; ++j)
        o[j] = static_cast<T>(static_cast<float>(norm_weight[first + j]) * (gated[j] * inverse));
    }
  });
}

template <typename T>
at::Tensor run(const at::Tensor& projected, const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
               const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& d_skip,
               const at::Tensor& norm_weight, double eps, const at::Tensor& conv_state, const at::Tensor& ssm_state,
               const Sizes& s, const Batch& b) {
  const int64_t tokens = projected.size(0);
  at::Tensor convolved = at::empty({tokens, s.conv_size()}, projected.options().dtype(at::kFloat));
  at::Tensor y = at::empty({tokens, s.inner()}, projected.options().dtype(at::kFloat));
  at::Tensor out = at::empty({tokens, s.inner()}, projected.options());
  const T* in = projected.data_ptr<T>();
  const T* bias = conv_bias.has_value() ? conv_bias->data_ptr<T>() : nullptr;
  ember::recurrent::convolve_silu<T>(in, s.row(), s.inner(), s.conv_size(), conv_weight.data_ptr<T>(), bias, s.kernel,
                                     conv_state.data_ptr<T>(), convolved.data_ptr<float>(), b);
  scan<T>(in, convolved.data_ptr<float>(), a_log.data_ptr<T>(), dt_bias.data_ptr<T>(), d_skip.data_ptr<T>(),
          ssm_state.data_ptr<float>(), y.data_ptr<float>(), s, b);
  gated_norm<T>(in, y.data_ptr<float>(), norm_weight.data_ptr<T>(), eps, out.data_ptr<T>(), s, tokens);
  return out;
}

}  // namespace

namespace ember {

// projected: [tokens, z | x B C | dt] (the input projection's output); conv_weight [conv, kernel];
// conv_state [slots, conv, kernel - 1] and ssm_state [slots, heads, state, head_dim] (float32) are
// updated in place for each sequence's slot. Returns [tokens, heads * head_dim].
at::Tensor mamba2(const at::Tensor& projected, const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
                  const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& d_skip,
                  const at::Tensor& norm_weight, double eps, const at::Tensor& conv_state, const at::Tensor& ssm_state,
                  const at::Tensor& starts, const at::Tensor& slots, const at::Tensor& fresh, int64_t num_groups,
                  double time_step_min, double time_step_max) {
  const auto dtype = projected.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "mamba2: float32 or bfloat16, got ", dtype);
  for (const at::Tensor* t : {&conv_weight, &a_log, &dt_bias, &d_skip, &norm_weight, &conv_state})
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous(), "mamba2: weights and conv state must be ", dtype,
                " and contiguous");
  if (conv_bias.has_value())
    TORCH_CHECK(conv_bias->scalar_type() == dtype && conv_bias->is_contiguous(), "mamba2: conv bias must be ", dtype);
  TORCH_CHECK(projected.is_contiguous() && projected.dim() == 2, "mamba2: projected must be contiguous 2-D");
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat && ssm_state.is_contiguous() && ssm_state.dim() == 4,
              "mamba2: ssm_state must be a contiguous float32 [slots, heads, state, head_dim]");
  TORCH_CHECK(starts.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && fresh.scalar_type() == at::kBool,
              "mamba2: starts and slots int64, fresh bool");
  const Sizes s{ssm_state.size(1), ssm_state.size(3), ssm_state.size(2), num_groups, conv_weight.size(1),
                time_step_min, time_step_max};
  TORCH_CHECK(s.heads % num_groups == 0 && projected.size(1) == s.row() && conv_weight.size(0) == s.conv_size() &&
                  conv_state.size(1) == s.conv_size() && conv_state.size(2) == s.kernel - 1 &&
                  norm_weight.numel() == s.inner() && a_log.numel() == s.heads && dt_bias.numel() == s.heads &&
                  d_skip.numel() == s.heads,
              "mamba2: sizes do not agree");
  const Batch b{starts.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), fresh.data_ptr<bool>(), slots.size(0)};
  TORCH_CHECK(starts.size(0) == b.sequences + 1 && b.starts[b.sequences] == projected.size(0),
              "mamba2: starts must bound every token");
  if (dtype == at::kBFloat16)
    return run<BFloat16>(projected, conv_weight, conv_bias, a_log, dt_bias, d_skip, norm_weight, eps, conv_state,
                         ssm_state, s, b);
  return run<float>(projected, conv_weight, conv_bias, a_log, dt_bias, d_skip, norm_weight, eps, conv_state, ssm_state,
                    s, b);
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def(
      "mamba2(Tensor projected, Tensor conv_weight, Tensor? conv_bias, Tensor a_log, Tensor dt_bias, Tensor d_skip, "
      "Tensor norm_weight, float eps, Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor starts, Tensor slots, "
      "Tensor fresh, int num_groups, float time_step_min, float time_step_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("mamba2", &ember::mamba2); }
