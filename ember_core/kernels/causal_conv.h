// What the hybrid mixers' kernels share (gated_delta_net.cpp, mamba2.cpp): a step's sequences and
// their state slots, and the causal depthwise convolution (with SiLU) over a slice of each token's
// input projection, which reads the inputs before a sequence's chunk from its slot's conv state.
//
// Each output value comes from its own loop in a fixed order and the work splits only along
// (sequence, channel), so a token's bits never depend on how its prompt was chunked or batched.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec8.h"

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
// be null). conv_state [slots, channels, kernel - 1] then keeps each sequence's last inputs. Eight
// channels at a time, one per lane, each in its own order: the sum j by j, then silu.
template <typename T>
void convolve_silu(const T* projected, int64_t row, int64_t offset, int64_t channels, const T* weight,
                   const T* bias, int64_t kernel, T* conv_state, float* convolved, const Batch& b) {
  const int64_t history = kernel - 1, groups = (channels + kLanes - 1) / kLanes;
  at::parallel_for(0, b.sequences * groups, 16, [&](int64_t begin, int64_t end) {
    std::vector<vfloat> window, w(kernel);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / groups, first = item % groups * kLanes, lanes = std::min(kLanes, channels - first);
      const int64_t start = b.starts[seq], count = b.starts[seq + 1] - start;
      T* state = conv_state + (b.slots[seq] * channels + first) * history;
      window.assign(history + count, vfloat{});
      vfloat total_bias{};
      for (int64_t l = 0; l < lanes; ++l) {
        const int64_t c = first + l;
        if (!b.fresh[seq])
          for (int64_t j = 0; j < history; ++j) window[j][l] = static_cast<float>(state[l * history + j]);
        for (int64_t t = 0; t < count; ++t) window[history + t][l] = static_cast<float>(projected[(start + t) * row + offset + c]);
        for (int64_t j = 0; j < kernel; ++j) w[j][l] = static_cast<float>(weight[c * kernel + j]);
        if (bias != nullptr) total_bias[l] = static_cast<float>(bias[c]);
      }
      for (int64_t t = 0; t < count; ++t) {
        vfloat total = total_bias;
        for (int64_t j = 0; j < kernel; ++j) total = total + w[j] * window[t + j];
        const vfloat activated = total * sigmoid_vector(total);
        for (int64_t l = 0; l < lanes; ++l) convolved[(start + t) * channels + first + l] = as_model<T>(activated[l]);
      }
      for (int64_t l = 0; l < lanes; ++l)
        for (int64_t j = 0; j < history; ++j) state[l * history + j] = static_cast<T>(window[count + j][l]);
    }
  });
}

}  // namespace ember::recurrent
