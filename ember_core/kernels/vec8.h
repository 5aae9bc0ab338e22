// Eight floats as one vector (GCC/Clang vector extensions): one AVX2 register, and plain code the
// compiler splits on narrower machines. Shared by ember's C++ CPU ops. Everything sits in an
// anonymous namespace: every translation unit keeps its own copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

// AVX-512 (F + DQ): the linears hold two rows' 8 lanes in one 16-float register (small_batch_linear.cpp).
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__) && defined(__F16C__)
#define EMBER_AVX512 1
#endif

namespace {

constexpr int64_t kLanes = 8;
using vfloat = float __attribute__((vector_size(kLanes * sizeof(float))));
using vint = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat broadcast(float x) { return vfloat{} + x; }

// Zeroes an array of accumulators element by element. `= {}` on one became `rep stos` over the
// stack copy of the array (GCC turns a zeroing loop into memset), ~1 KiB per tile or chunk call,
// which perf showed as 15% of a tile kernel's samples; unrolled, the zeros stay in registers.
template <typename Vector, size_t N>
inline void set_zero(Vector (&vectors)[N]) {
#pragma GCC unroll 32
  for (Vector& v : vectors) v = Vector{};
}

template <typename Vector, size_t M, size_t N>
inline void set_zero(Vector (&vectors)[M][N]) {
#pragma GCC unroll 32
  for (auto& row : vectors) set_zero(row);
}

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// a * b + c, rounded once wherever the target has FMA. The ops are built with -ffp-contract=off
// (cpu_ops.py): left to the compiler, whether `acc += a * b` is fused depends on the code around it
// and on the tuning (GCC's Zen 4 tuning avoids some FMA chains), so one path of a kernel would
// round differently from another. A multiply-add meant as one rounding says so here.
inline vfloat multiply_add(vfloat a, vfloat b, vfloat c) {
#if defined(__FMA__)
  return reinterpret_cast<vfloat>(
      _mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

// Eight bfloat16 values widened to float32 (exact), and eight float32 values rounded to bfloat16
// to nearest even as c10::BFloat16(float) does (a NaN stays a NaN).
using vuint = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
using vbf16 = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline vfloat load_bf16(const void* p) {
#if defined(__AVX2__)
  // GCC widens the generic form below half by half (6 instructions); this is 2.
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return reinterpret_cast<vfloat>(_mm256_slli_epi32(bits, 16));
#else
  vbf16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<vfloat>(__builtin_convertvector(bits, vuint) << 16);
#endif
}

inline void store_bf16(void* p, vfloat v) {
  const vuint bits = reinterpret_cast<vuint>(v);
  const vuint rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vbf16 out = __builtin_convertvector(v != v ? vuint{} + 0x7FC0u : rounded, vbf16);
  std::memcpy(p, &out, sizeof(out));
}

// The first `count` (at most kLanes) bfloat16 values at p, widened (the other lanes 0); and the
// first `count` lanes of v stored as bfloat16: the tails of rows that are not whole vectors.
inline vfloat load_bf16_first(const void* p, int64_t count) {
  if (count == kLanes) return load_bf16(p);
  uint16_t lanes[kLanes] = {};
  std::memcpy(lanes, p, count * sizeof(uint16_t));
  return load_bf16(lanes);
}

inline void store_bf16_first(void* p, vfloat v, int64_t count) {
  if (count == kLanes) return store_bf16(p, v);
  uint16_t lanes[kLanes];
  store_bf16(lanes, v);
  std::memcpy(p, lanes, count * sizeof(uint16_t));
}

inline float sum(vfloat v) {
  float total = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// exp for x <= 0 (Cephes' polynomial, relative error ~2e-7) as vector code, since std::exp is a libm
// call per element. Below -87 the result would leave float's normal range: it is flushed to 0.
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat round_magic = broadcast(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const auto underflow = x < -87.0f;
  x = underflow ? broadcast(-87.0f) : x;
  const vfloat shifted = x * 1.44269504088896341f + round_magic;
  const vfloat n = shifted - round_magic;
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = broadcast(1.9875691500e-4f);
  for (const float coefficient : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = multiply_add(p, r, broadcast(coefficient));
  p = p * r * r + r + 1.0f;
  const vint exponent = (reinterpret_cast<vint>(shifted) - reinterpret_cast<vint>(round_magic) + 127) << 23;
  return underflow ? vfloat{} : p * reinterpret_cast<vfloat>(exponent);
}

// sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0 and e / (1 + e) below, so nothing overflows.
inline vfloat sigmoid_vector(vfloat g) {
  const vfloat e = exp_nonpositive(g < 0.0f ? g : -g);
  return (g < 0.0f ? e : broadcast(1.0f)) / (1.0f + e);
}

// tanh as vector code (Cephes' tanhf): an odd polynomial below |x| = 0.625, where 1 - 2 / (e^2x + 1)
// would lose digits to cancellation, and that form from exp_nonpositive(-2|x|) above it. Absolute
// error ~1e-7 over the whole range; saturates to +-1 without overflow.
inline vfloat tanh_vector(vfloat x) {
  const vfloat magnitude = x < 0.0f ? -x : x;
  const vfloat z = x * x;
  vfloat p = broadcast(-5.70498872745e-3f);
  for (const float coefficient : {2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f, -3.33332819422e-1f})
    p = multiply_add(p, z, broadcast(coefficient));
  const vfloat small = multiply_add(p * z, x, x);
  const vfloat e = exp_nonpositive(-2.0f * magnitude);
  const vfloat large = (1.0f - e) / (1.0f + e);
  const vfloat signed_large = x < 0.0f ? -large : large;
  return magnitude < 0.625f ? small : signed_large;
}

}  // namespace
