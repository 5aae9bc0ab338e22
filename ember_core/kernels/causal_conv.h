// What the hybrid mixers' kernels share (gated_delta_net.cpp, mamba2.cpp): a step's sequences and
// their state slots, and the causal depthwise convolution (with SiLU) over a slice of each token's
// input projection, which reads the inputs before a sequence's chunk from its slot's conv state.
//
// Each output value comes from its own loop in a fixed order and the work splits only along
// (sequence, channel), so a token's bits never depend on how its prompt was chunked or batched.

#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace ember::recurrent {

struct Batch {
  const int64_t* starts;  // [sequences + 1] token offsets
  const int64_t* slots;   // [sequences] state slots
  const bool* fresh;      // [sequences] start from zero states (a sequence's first tokens)
  int64_t sequences;
};

inline float sigmoid(float x) { return x >= 0.0f ? 1.0f / (1.0f + std::exp(-x)) : std::exp(x) / (1.0f + std::exp(x)); }

// torch's softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// A value as the model's dtype holds it: bfloat16 rounds, float32 stays.
template <typename T>
inline float as_model(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// convolved[t][c] = silu(bias[c] + sum_j w[c][j] * x[t - kernel + 1 + j][c]) in float32, rounded to the
// model's dtype as transformers' conv output is; x[t][c] = projected[t * row + offset + c] (bias may
// be null). conv_state [slots, channels, kernel - 1] then keeps each sequence's last inputs.
template <typename T>
void convolve_silu(const T* projected, int64_t row, int64_t offset, int64_t channels, const T* weight,
                   const T* bias, int64_t kernel, T* conv_state, float* convolved, const Batch& b) {
  const int64_t history = kernel - 1;
  at::parallel_for(0, b.sequences * channels, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> window;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / channels, c = item % channels;
      const int64_t start = b.starts[seq], count = b.starts[seq + 1] - start;
      T* state = conv_state + (b.slots[seq] * channels + c) * history;
      window.assign(history + count, 0.0f);
      if (!b.fresh[seq])
        for (int64_t j = 0; j < history; ++j) window[j] = static_cast<float>(state[j]);
      for (int64_t t = 0; t < count; ++t)
        window[history + t] = static_cast<float>(projected[(start + t) * row + offset + c]);
      const T* w = weight + c * kernel;
      const float first = bias != nullptr ? static_cast<float>(bias[c]) : 0.0f;
      for (int64_t t = 0; t < count; ++t) {
        float total = first;
        for (int64_t j = 0; j < kernel; ++j) total += static_cast<float>(w[j]) * window[t + j];
        convolved[(start + t) * channels + c] = as_model<T>(total * sigmoid(total));
      }
      for (int64_t j = 0; j < history; ++j) state[j] = static_cast<T>(window[count + j]);
    }
  });
}

}  // namespace ember::recurrent
