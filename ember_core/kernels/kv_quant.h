// The 8-bit KV cache's rows (`--kv-cache-dtype int8|fp8_e4m3`): each token's K (or V) of one KV
// head, rotated (below), is head_dim 8-bit values followed by their float16 scale, as a GGUF Q8_0
// block keeps its scale beside its values. A value reads back as code * scale; the scale is
// absmax / 127 (int8) or absmax / 448 (e4m3's largest finite value), so every row spends the whole
// 8-bit range.
//
// One scale per token and head, not per block: a row is quantized once, when its token is written,
// from that token's values alone, so its bits do not depend on which tokens share its block, how a
// prompt was chunked, or what the batch held; a per-block scale would have to requantize the block
// (or clip) as later tokens arrive. Its 2 bytes cost 3% of a 64-wide head.
//
// A head is rotated before it is quantized: multiplied by a normalized Walsh-Hadamard matrix H
// (block-diagonal where head_dim is not a power of two: blocks of its largest power-of-two divisor).
// Rotation spreads a few large channels (RoPE'd keys have them) over the whole row, so the absmax
// that sets the row's step falls and every value is quantized finer: on SmolLM2 over 2,048 tokens,
// KL to the float cache 0.00081 -> 0.00021, top-1 agreement 97.9% -> 99.2%. H is orthonormal and its
// own inverse, so the kernels never rotate the cache back: q.k = Hq.Hk, so a query is rotated once,
// and sum(p v) = H sum(p Hv), so a head's output is rotated once more (QuaRot, SpinQuant).
//
// e4m3 codes are widened through float16: the code's sign, exponent and mantissa bits shifted into a
// float16's read as the value / 256 (subnormals included), so the kernels fold 256 into the scale.
// The writer never makes e4m3's NaN code: values are clamped to +-448 first.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec8.h"

namespace {

constexpr int64_t kScaleBytes = 2;  // the float16 after a row's values

// The cache tensor dtypes that hold such rows: int8 and float8_e4m3fn.
inline bool is_quantized_cache(c10::ScalarType cache) {
  return cache == c10::ScalarType::Char || cache == c10::ScalarType::Float8_e4m3fn;
}

template <typename T>
constexpr bool kQuantizedCache = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn>;

// The largest code magnitude a row's absmax maps to.
template <typename T>
constexpr float kCodeMax = std::is_same_v<T, int8_t> ? 127.0f : 448.0f;

// What a row's stored scale is multiplied by before it meets the codes as the kernels widen them.
template <typename T>
constexpr float kWidenedUnit = std::is_same_v<T, int8_t> ? 1.0f : 256.0f;

inline float code_value(int8_t code) { return static_cast<float>(code); }

// An e4m3 code as float16 bits (value / 256, exactly).
inline uint16_t e4m3_as_half_bits(uint8_t code) {
  return static_cast<uint16_t>(((code & 0x80u) << 8) | ((code & 0x7Fu) << 7));
}

inline float code_value(c10::Float8_e4m3fn code) {
  return static_cast<float>(c10::Half(e4m3_as_half_bits(code.x), c10::Half::from_bits()));
}

// A quantized row's scale, times the unit of its widened codes.
template <typename T>
inline float row_scale(const T* row, int64_t head_dim) {
  uint16_t bits;
  std::memcpy(&bits, row + head_dim, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits) * kWidenedUnit<T>;  // c10::Half's conversion is bit twiddling, ~10x the cost
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits())) * kWidenedUnit<T>;
#endif
}

// One stage of butterflies within each 8-lane vector, pairs `Half` lanes apart (1, 2 or 4):
// a + b * (+-1), which is a + b or exactly a - b.
template <int Half>
inline vfloat lane_butterflies(vfloat v) {
  static_assert(Half == 1 || Half == 2 || Half == 4);
  if constexpr (Half == 1)
    return __builtin_shufflevector(v, v, 0, 0, 2, 2, 4, 4, 6, 6) +
           __builtin_shufflevector(v, v, 1, 1, 3, 3, 5, 5, 7, 7) * vfloat{1, -1, 1, -1, 1, -1, 1, -1};
  else if constexpr (Half == 2)
    return __builtin_shufflevector(v, v, 0, 1, 0, 1, 4, 5, 4, 5) +
           __builtin_shufflevector(v, v, 2, 3, 2, 3, 6, 7, 6, 7) * vfloat{1, 1, -1, -1, 1, 1, -1, -1};
  else
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 0, 1, 2, 3) +
           __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7) * vfloat{1, 1, 1, 1, -1, -1, -1, -1};
}

// x <- H x, in place: the fast Walsh-Hadamard transform's butterflies (a + b, a - b), stage by
// stage (pairs 1, 2, 4, ... apart) over each block, then 1/sqrt(block). Every value goes through
// the same additions in the same order on either path, and as layers/kv_quant.py's rotate: equal
// bits. A cache write rotates two rows per token and head, attention a query and an output.
inline void rotate_row(float* x, int64_t head_dim) {
  const int64_t block = head_dim & -head_dim;
  if (block == 1) return;
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  if (block >= kLanes) {  // the first three stages within vectors, the others between them
    for (int64_t i = 0; i < head_dim; i += kLanes)
      store(x + i, lane_butterflies<4>(lane_butterflies<2>(lane_butterflies<1>(load(x + i)))));
    for (int64_t half = kLanes; half < block; half *= 2)
      for (int64_t pair = 0; pair < head_dim; pair += 2 * half)
        for (int64_t i = pair; i < pair + half; i += kLanes) {
          const vfloat a = load(x + i), b = load(x + i + half);
          store(x + i, a + b);
          store(x + i + half, a - b);
        }
    for (int64_t i = 0; i < head_dim; i += kLanes) store(x + i, load(x + i) * norm);
    return;
  }
  for (int64_t half = 1; half < block; half *= 2)
    for (int64_t pair = 0; pair < head_dim; pair += 2 * half)
      for (int64_t i = pair; i < pair + half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a + b;
        x[i + half] = a - b;
      }
  for (int64_t i = 0; i < head_dim; ++i) x[i] *= norm;
}

// Rounds to the nearest integer, ties to even (std::nearbyint's default), for |x| <= 2^22: adding
// 1.5 * 2^23 leaves no bits below the units. Built without -ffast-math, nothing folds it away.
inline vfloat round_to_integer(vfloat x) {
  constexpr float kShift = 12582912.0f;
  return (x + kShift) - kShift;
}

// Quantizes head_dim floats into a row (codes, then the float16 scale); 8 at a time where head_dim
// allows, the same arithmetic as the scalar tail.
template <typename T>
inline void quantize_row(const float* in, int64_t head_dim, T* row) {
  const int64_t vectors_end = head_dim / kLanes * kLanes;
  vfloat absmaxes{};
  for (int64_t i = 0; i < vectors_end; i += kLanes) {
    const vfloat magnitude = reinterpret_cast<vfloat>(reinterpret_cast<vint>(load(in + i)) & 0x7fffffff);
    absmaxes = magnitude > absmaxes ? magnitude : absmaxes;
  }
  float absmax = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) absmax = std::max(absmax, absmaxes[j]);
  for (int64_t i = vectors_end; i < head_dim; ++i) absmax = std::max(absmax, std::abs(in[i]));
  const c10::Half scale(absmax / kCodeMax<T>);
  const float step = static_cast<float>(scale);
  std::memcpy(row + head_dim, &scale.x, sizeof(scale.x));
  if (step == 0.0f) {
    std::memset(static_cast<void*>(row), 0, head_dim * sizeof(T));
    return;
  }
  // The float16 scale may round down: clamp the few codes that would pass the top.
  int64_t i = 0;
  if constexpr (std::is_same_v<T, int8_t>)
    for (; i < vectors_end; i += kLanes) {
      vfloat x = load(in + i) / step;
      x = x > kCodeMax<T> ? broadcast(kCodeMax<T>) : x;
      x = x < -kCodeMax<T> ? broadcast(-kCodeMax<T>) : x;
      using vcodes = int8_t __attribute__((vector_size(kLanes)));
      const vcodes codes = __builtin_convertvector(__builtin_convertvector(round_to_integer(x), vint), vcodes);
      std::memcpy(row + i, &codes, sizeof(codes));
    }
  for (; i < head_dim; ++i) {
    const float x = std::clamp(in[i] / step, -kCodeMax<T>, kCodeMax<T>);
    if constexpr (std::is_same_v<T, int8_t>)
      row[i] = static_cast<int8_t>(std::nearbyint(x));
    else
      row[i] = c10::Float8_e4m3fn(x);
  }
}

}  // namespace
