// LFM2's gated short convolution between its input and output projections (layers/short_conv.py), for
// the prompt chunks and decodes of one step: y = C * conv(B * x), the causal depthwise convolution
// reading each sequence's last inputs from its state slot. Every value comes from its own loop in a
// fixed order, rounded to the model's dtype where transformers' ops round, so a token's bits never
// depend on how its prompt was chunked or batched.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "causal_conv.h"
#include "ops.h"

namespace {

using c10::BFloat16;

using ember::recurrent::as_model;

// projected: [tokens, B | C | x] of `channels` each; state: [slots, channels, kernel - 1].
template <typename T>
at::Tensor run(const at::Tensor& projected, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               const at::Tensor& conv_state, const int64_t* starts, const int64_t* slots, const bool* fresh,
               int64_t sequences) {
  const int64_t tokens = projected.size(0), channels = weight.size(0), kernel = weight.size(1), history = kernel - 1;
  at::Tensor out = at::empty({tokens, channels}, projected.options());
  const T* in = projected.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* state_all = conv_state.data_ptr<T>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, sequences * channels, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> window;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / channels, c = item % channels;
      const int64_t start = starts[seq], count = starts[seq + 1] - start;
      T* state = state_all + (slots[seq] * channels + c) * history;
      window.assign(history + count, 0.0f);
      if (!fresh[seq])
        for (int64_t j = 0; j < history; ++j) window[j] = static_cast<float>(state[j]);
      for (int64_t t = 0; t < count; ++t) {
        const T* row = in + (start + t) * 3 * channels;
        window[history + t] = as_model<T>(static_cast<float>(row[c]) * static_cast<float>(row[2 * channels + c]));
      }
      for (int64_t t = 0; t < count; ++t) {
        float total = b != nullptr ? static_cast<float>(b[c]) : 0.0f;
        for (int64_t j = 0; j < kernel; ++j) total += static_cast<float>(w[c * kernel + j]) * window[t + j];
        const float gate = static_cast<float>(in[(start + t) * 3 * channels + channels + c]);
        y[(start + t) * channels + c] = static_cast<T>(gate * as_model<T>(total));
      }
      for (int64_t j = 0; j < history; ++j) state[j] = static_cast<T>(window[count + j]);
    }
  });
  return out;
}

}  // namespace

namespace ember {

// projected [tokens, 3 * channels] (B, C, x), weight [channels, kernel], bias [channels] or none,
// conv_state [slots, channels, kernel - 1] updated in place per sequence's slot. Returns C * conv(B * x).
at::Tensor short_conv(const at::Tensor& projected, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const at::Tensor& conv_state, const at::Tensor& starts, const at::Tensor& slots,
                      const at::Tensor& fresh) {
  const auto dtype = projected.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "short_conv: float32 or bfloat16, got ", dtype);
  TORCH_CHECK(projected.dim() == 2 && projected.is_contiguous() && weight.is_contiguous() && conv_state.is_contiguous() &&
                  weight.scalar_type() == dtype && conv_state.scalar_type() == dtype &&
                  (!bias.has_value() || (bias->scalar_type() == dtype && bias->is_contiguous())),
              "short_conv: contiguous operands of one dtype");
  const int64_t channels = weight.size(0);
  TORCH_CHECK(projected.size(1) == 3 * channels && conv_state.size(1) == channels && conv_state.size(2) == weight.size(1) - 1,
              "short_conv: sizes do not agree");
  TORCH_CHECK(starts.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && fresh.scalar_type() == at::kBool,
              "short_conv: starts and slots int64, fresh bool");
  const int64_t sequences = slots.size(0);
  TORCH_CHECK(starts.size(0) == sequences + 1 && starts.data_ptr<int64_t>()[sequences] == projected.size(0),
              "short_conv: starts must bound every token");
  if (dtype == at::kBFloat16)
    return run<BFloat16>(projected, weight, bias, conv_state, starts.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                         fresh.data_ptr<bool>(), sequences);
  return run<float>(projected, weight, bias, conv_state, starts.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                    fresh.data_ptr<bool>(), sequences);
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def(
      "short_conv(Tensor projected, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor starts, Tensor slots, "
      "Tensor fresh) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("short_conv", &ember::short_conv); }
