// Qwen3.5's Gated DeltaNet mixer between its input and output projections (layers/gated_delta_net.py),
// for the prompt chunks and decodes of one step: the causal depthwise convolution over q/k/v, the
// gated delta rule's recurrence per value head, and the gated RMSNorm of its output.
//
// Every token runs the same arithmetic whether it arrives in a prompt, a chunk of one, or a decode,
// alone or beside other sequences: the recurrence is computed token by token (never the chunked
// form transformers uses for prompts), each output value from its own loop in a fixed order, and
// the work splits across threads only along independent values (channels, heads, tokens). That is
// what keeps ember's bitwise invariant for hybrid models.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "causal_conv.h"
#include "ops.h"

namespace {

using c10::BFloat16;
using ember::recurrent::as_model;
using ember::recurrent::Batch;
using ember::recurrent::sigmoid;
using ember::recurrent::softplus;

struct Sizes {
  int64_t num_key_heads, num_value_heads, key_dim, value_dim, kernel;
  bool tiled;  // value head h reads q/k head h % num_key_heads (llama.cpp's order), else h / group
  int64_t key_head(int64_t h) const { return tiled ? h % num_key_heads : h / (num_value_heads / num_key_heads); }
  int64_t key_size() const { return num_key_heads * key_dim; }
  int64_t value_size() const { return num_value_heads * value_dim; }
  int64_t conv_size() const { return 2 * key_size() + value_size(); }
  // projected's row: [q k v | z | b | a]
  int64_t row() const { return conv_size() + value_size() + 2 * num_value_heads; }
};

// x / sqrt(sum(x^2) + 1e-6), the fla library's l2norm as transformers writes it, times scale.
void l2_normalised(const float* x, int64_t n, float scale, float* out) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += x[i] * x[i];
  const float inverse = 1.0f / std::sqrt(total + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inverse * scale;
}

#if defined(__AVX512F__)
// Columns [first, first + 16 V) of every row of S: S_t = g S_{t-1} + k delta^T written back, the
// columns' S_t^T k' and S_t^T q' summed over the rows in registers. Each lane takes the scalar
// loop's steps (no fused multiply-add): the same bits.
template <int V>
inline void sweep_vectors(float* __restrict__ state, int64_t dk, int64_t dv, int64_t first, float last_decay,
                          const float* __restrict__ last_key, const float* __restrict__ last_delta,
                          const float* __restrict__ k, const float* __restrict__ q, float* __restrict__ reads_k,
                          float* __restrict__ reads_q) {
  __m512 sum_k[V], sum_q[V], delta[V];
  const __m512 decay = _mm512_set1_ps(last_decay);
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    sum_k[v] = sum_q[v] = _mm512_setzero_ps();
    delta[v] = _mm512_loadu_ps(last_delta + first + 16 * v);
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict__ cells = state + i * dv + first;
    const __m512 update_key = _mm512_set1_ps(last_key[i]), key = _mm512_set1_ps(k[i]), query = _mm512_set1_ps(q[i]);
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const __m512 value = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(cells + 16 * v), decay),
                                         _mm512_mul_ps(update_key, delta[v]));
      _mm512_storeu_ps(cells + 16 * v, value);
      sum_k[v] = _mm512_add_ps(sum_k[v], _mm512_mul_ps(value, key));
      sum_q[v] = _mm512_add_ps(sum_q[v], _mm512_mul_ps(value, query));
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    _mm512_storeu_ps(reads_k + first + 16 * v, sum_k[v]);
    _mm512_storeu_ps(reads_q + first + 16 * v, sum_q[v]);
  }
}
#endif

// One pass over S (dk rows of dv): S_t = g S_{t-1} + k delta^T written back; reads_k = S_t^T k' and
// reads_q = S_t^T q', each column's sum in row order. AVX-512 builds keep up to 128 columns' sums in
// registers through the rows (a sweep per 128 columns); the rest, column by column in memory.
inline void sweep_state(float* __restrict__ state, int64_t dk, int64_t dv, float last_decay,
                        const float* __restrict__ last_key, const float* __restrict__ last_delta,
                        const float* __restrict__ k, const float* __restrict__ q, float* __restrict__ reads_k,
                        float* __restrict__ reads_q) {
  int64_t first = 0;
#if defined(__AVX512F__)
  for (; first + 128 <= dv; first += 128)
    sweep_vectors<8>(state, dk, dv, first, last_decay, last_key, last_delta, k, q, reads_k, reads_q);
  for (; first + 16 <= dv; first += 16)
    sweep_vectors<1>(state, dk, dv, first, last_decay, last_key, last_delta, k, q, reads_k, reads_q);
#endif
  if (first == dv) return;
  for (int64_t j = first; j < dv; ++j) reads_k[j] = reads_q[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict__ state_row = state + i * dv;
    const float update_key = last_key[i], key = k[i], query = q[i];
    for (int64_t j = first; j < dv; ++j) {
      const float value = state_row[j] * last_decay + update_key * last_delta[j];
      state_row[j] = value;
      reads_k[j] += value * key;
      reads_q[j] += value * query;
    }
  }
}

// The gated delta rule, per (sequence, value head), token by token, with q and k l2-normalised and q
// scaled by key_dim^-1/2: S_t = g S_{t-1} + k delta^T, delta = beta (v - g S_{t-1}^T k), o = S_t^T q.
//
// One pass over S per token: the state holds S_{t-1} and the last token's pending update (its g, k
// and delta, `pending`), and S_t = g S_{t-1} + k delta^T is written as the next token reads it. That
// same pass reads S_t^T k' and S_t^T q' for the next token t', whose recall is g' S_t^T k' and whose
// output is g' S_t^T q' + (k'.q') delta'. Against two passes per token (decay and recall, then
// update and answer), each reading and writing the 64 KiB of S per head: 1.12-1.19x as fast on
// Sapphire Rapids (docs/benchmarks.md), prompts and decodes alike.
template <typename T>
void recur(const T* projected, const float* convolved, const T* a_log, const T* dt_bias, float* recurrent_state,
           float* pending_state, float* core, const Sizes& s, const Batch& b) {
  const int64_t heads = s.num_value_heads, dk = s.key_dim, dv = s.value_dim, channels = s.conv_size(), row = s.row();
  const int64_t pending_size = 1 + dk + dv;  // [g | k | delta]
  const float query_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, b.sequences * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(dk), k(dk), recalled(dv), answered(dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / heads, h = item % heads, key_head = s.key_head(h);
      const int64_t start = b.starts[seq], count = b.starts[seq + 1] - start;
      float* state = recurrent_state + (b.slots[seq] * heads + h) * dk * dv;
      float* pending = pending_state + (b.slots[seq] * heads + h) * pending_size;
      if (b.fresh[seq]) {
        for (int64_t i = 0; i < dk * dv; ++i) state[i] = 0.0f;
        for (int64_t i = 0; i < pending_size; ++i) pending[i] = 0.0f;
      }
      const float decay_rate = -std::exp(static_cast<float>(a_log[h]));
      for (int64_t t = 0; t < count; ++t) {
        const int64_t token = start + t;
        const float* x = convolved + token * channels;
        l2_normalised(x + key_head * dk, dk, query_scale, q.data());
        l2_normalised(x + s.key_size() + key_head * dk, dk, 1.0f, k.data());
        const float* v = x + 2 * s.key_size() + h * dv;
        const T* gates = projected + token * row + channels + s.value_size();
        const float beta = sigmoid(static_cast<float>(gates[h]));
        const float decay =
            std::exp(decay_rate * softplus(static_cast<float>(gates[heads + h]) + static_cast<float>(dt_bias[h])));
        const float last_decay = pending[0];
        const float* __restrict__ last_key = pending + 1;
        const float* __restrict__ last_delta = pending + 1 + dk;
        float* __restrict__ reads_k = recalled.data();
        float* __restrict__ reads_q = answered.data();
        sweep_state(state, dk, dv, last_decay, last_key, last_delta, k.data(), q.data(), reads_k, reads_q);
        float key_dot_query = 0.0f;
        for (int64_t i = 0; i < dk; ++i) key_dot_query += k[i] * q[i];
        float* __restrict__ delta = pending + 1 + dk;
        float* __restrict__ o = core + token * s.value_size() + h * dv;
        for (int64_t j = 0; j < dv; ++j) {
          delta[j] = (v[j] - reads_k[j] * decay) * beta;
          o[j] = reads_q[j] * decay + key_dot_query * delta[j];
        }
        pending[0] = decay;
        for (int64_t i = 0; i < dk; ++i) pending[1 + i] = k[i];
      }
    }
  });
}

// out = weight * rmsnorm(o) * silu(z) per value head, in transformers' roundings (Qwen3_5RMSNormGated).
template <typename T>
void gated_norm(const T* projected, const float* core, const T* norm_weight, double eps, T* out, const Sizes& s,
                int64_t tokens) {
  const int64_t heads = s.num_value_heads, dv = s.value_dim, row = s.row();
  at::parallel_for(0, tokens * heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t token = item / heads, h = item % heads;
      const float* o = core + token * s.value_size() + h * dv;
      const T* z = projected + token * row + s.conv_size() + h * dv;
      float total = 0.0f;
      for (int64_t j = 0; j < dv; ++j) total += as_model<T>(o[j]) * as_model<T>(o[j]);
      const float inverse = 1.0f / std::sqrt(total / static_cast<float>(dv) + static_cast<float>(eps));
      T* y = out + token * s.value_size() + h * dv;
      for (int64_t j = 0; j < dv; ++j) {
        const float normed = as_model<T>(static_cast<float>(norm_weight[j]) * as_model<T>(as_model<T>(o[j]) * inverse));
        const float gate = static_cast<float>(z[j]);
        y[j] = static_cast<T>(normed * (gate * sigmoid(gate)));
      }
    }
  });
}

template <typename T>
at::Tensor run(const at::Tensor& projected, const at::Tensor& conv_weight, const at::Tensor& a_log,
               const at::Tensor& dt_bias, const at::Tensor& norm_weight, double eps, const at::Tensor& conv_state,
               const at::Tensor& recurrent_state, const at::Tensor& pending_state, const Sizes& s, const Batch& b) {
  const int64_t tokens = projected.size(0);
  at::Tensor convolved = at::empty({tokens, s.conv_size()}, projected.options().dtype(at::kFloat));
  at::Tensor core = at::empty({tokens, s.value_size()}, projected.options().dtype(at::kFloat));
  at::Tensor out = at::empty({tokens, s.value_size()}, projected.options());
  const T* in = projected.data_ptr<T>();
  ember::recurrent::convolve_silu<T>(in, s.row(), 0, s.conv_size(), conv_weight.data_ptr<T>(), nullptr, s.kernel,
                                     conv_state.data_ptr<T>(), convolved.data_ptr<float>(), b);
  recur<T>(in, convolved.data_ptr<float>(), a_log.data_ptr<T>(), dt_bias.data_ptr<T>(),
           recurrent_state.data_ptr<float>(), pending_state.data_ptr<float>(), core.data_ptr<float>(), s, b);
  gated_norm<T>(in, core.data_ptr<float>(), norm_weight.data_ptr<T>(), eps, out.data_ptr<T>(), s, tokens);
  return out;
}

}  // namespace

namespace ember {

// projected: [tokens, q k v | z | b | a] (the fused input projection's output); conv_weight [conv, kernel];
// conv_state [slots, conv, kernel - 1], recurrent_state [slots, value heads, key_dim, value_dim] and
// pending_state [slots, value heads, 1 + key_dim + value_dim] (both float32; see recur) are updated
// in place for each sequence's slot. Returns [tokens, value heads * value_dim].
at::Tensor gated_delta_net(const at::Tensor& projected, const at::Tensor& conv_weight, const at::Tensor& a_log,
                           const at::Tensor& dt_bias, const at::Tensor& norm_weight, double eps,
                           const at::Tensor& conv_state, const at::Tensor& recurrent_state,
                           const at::Tensor& pending_state, const at::Tensor& starts, const at::Tensor& slots,
                           const at::Tensor& fresh, int64_t num_key_heads, int64_t key_dim, int64_t value_dim,
                           bool tiled_value_heads) {
  const auto dtype = projected.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gated_delta_net: float32 or bfloat16, got ", dtype);
  for (const at::Tensor* t : {&conv_weight, &a_log, &dt_bias, &norm_weight, &conv_state})
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous(), "gated_delta_net: weights and conv state must be ",
                dtype, " and contiguous");
  TORCH_CHECK(projected.is_contiguous() && projected.dim() == 2, "gated_delta_net: projected must be contiguous 2-D");
  TORCH_CHECK(recurrent_state.scalar_type() == at::kFloat && recurrent_state.is_contiguous() && recurrent_state.dim() == 4,
              "gated_delta_net: recurrent_state must be a contiguous float32 [slots, heads, key_dim, value_dim]");
  TORCH_CHECK(pending_state.scalar_type() == at::kFloat && pending_state.is_contiguous() && pending_state.dim() == 3 &&
                  pending_state.size(0) == recurrent_state.size(0) && pending_state.size(1) == recurrent_state.size(1) &&
                  pending_state.size(2) == 1 + key_dim + value_dim,
              "gated_delta_net: pending_state must be a contiguous float32 [slots, heads, 1 + key_dim + value_dim]");
  TORCH_CHECK(starts.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && fresh.scalar_type() == at::kBool,
              "gated_delta_net: starts and slots int64, fresh bool");
  const Sizes s{num_key_heads, recurrent_state.size(1), key_dim, value_dim, conv_weight.size(1), tiled_value_heads};
  TORCH_CHECK(projected.size(1) == s.row() && conv_weight.size(0) == s.conv_size() && recurrent_state.size(2) == key_dim &&
                  recurrent_state.size(3) == value_dim && conv_state.size(1) == s.conv_size() &&
                  conv_state.size(2) == s.kernel - 1 && s.num_value_heads % num_key_heads == 0,
              "gated_delta_net: sizes do not agree");
  const Batch b{starts.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), fresh.data_ptr<bool>(), slots.size(0)};
  TORCH_CHECK(starts.size(0) == b.sequences + 1 && b.starts[b.sequences] == projected.size(0),
              "gated_delta_net: starts must bound every token");
  if (dtype == at::kBFloat16)
    return run<BFloat16>(projected, conv_weight, a_log, dt_bias, norm_weight, eps, conv_state, recurrent_state,
                         pending_state, s, b);
  return run<float>(projected, conv_weight, a_log, dt_bias, norm_weight, eps, conv_state, recurrent_state,
                    pending_state, s, b);
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def(
      "gated_delta_net(Tensor projected, Tensor conv_weight, Tensor a_log, Tensor dt_bias, Tensor norm_weight, "
      "float eps, Tensor(a!) conv_state, Tensor(b!) recurrent_state, Tensor(c!) pending_state, Tensor starts, "
      "Tensor slots, Tensor fresh, int num_key_heads, int key_dim, int value_dim, bool tiled_value_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("gated_delta_net", &ember::gated_delta_net); }
