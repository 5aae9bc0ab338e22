// The machine's arithmetic peak, for `ember bench kernels --peak`: register-only loops of the build's
// widest float32 multiply-add, its 8-bit integer dot product and, where the build has it, its
// bfloat16 dot product (vdpbf16ps), on
// every thread at once. Each thread keeps kChains independent accumulators, more than the
// instruction's latency x throughput on the CPUs ember runs on, and touches no memory in the loop.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "vec8.h"

namespace {

constexpr int kChains = 12;

// Runs step(acc) `iterations` times on every thread; returns the threads' count. Each thread's
// accumulators end in a volatile store, so the loop cannot be dropped.
template <typename Vector, typename Step>
int64_t on_every_thread(int64_t iterations, Vector start, Step&& step) {
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Vector acc[kChains];
    for (Vector& a : acc) a = start;
    for (int64_t i = 0; i < iterations; ++i)
      for (Vector& a : acc) a = step(a);
    float total = 0.0f;
    for (const Vector& a : acc) {
      float first;
      std::memcpy(&first, &a, sizeof(first));  // integer vectors too: no aliasing through a cast
      total += first;
    }
    volatile float sink = total;
    (void)sink;
  });
  return threads;
}

int64_t fma_flops(int64_t iterations) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  const int64_t threads = on_every_thread(iterations, _mm512_set1_ps(1.0f), [&](__m512 c) { return _mm512_fmadd_ps(c, a, b); });
  return threads * iterations * kChains * 16 * 2;
#else
  const vfloat a = broadcast(0.999f), b = broadcast(1e-3f);
  const int64_t threads = on_every_thread(iterations, broadcast(1.0f), [&](vfloat c) { return multiply_add(c, a, b); });
  return threads * iterations * kChains * kLanes * 2;
#endif
}

int64_t bf16_dot_flops(int64_t iterations) {
#if defined(__AVX512BF16__)
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  const int64_t threads = on_every_thread(iterations, _mm512_set1_ps(1.0f), [&](__m512 c) { return _mm512_dpbf16_ps(c, a, a); });
  return threads * iterations * kChains * 32 * 2;
#else
  TORCH_CHECK(false, "peak_loop: this build has no bfloat16 dot product (it needs AVX512-BF16)");
#endif
}

// Multiply-adds of 8-bit integers (VNNI's vpdpbusd, 4 products into each 32-bit lane; AVX2's
// vpmaddubsw + vpmaddwd, two instructions for the same), counted as 2 operations each like a float FMA.
int64_t int8_dot_ops(int64_t iterations) {
#if defined(__AVX512VNNI__)
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(-1);
  const int64_t threads = on_every_thread(iterations, _mm512_setzero_si512(), [&](__m512i c) { return _mm512_dpbusd_epi32(c, a, b); });
  return threads * iterations * kChains * 64 * 2;
#elif defined(__AVX2__)
  const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(-1), ones = _mm256_set1_epi16(1);
  const int64_t threads = on_every_thread(iterations, _mm256_setzero_si256(), [&](__m256i c) {
    return _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
  });
  return threads * iterations * kChains * 32 * 2;
#else
  TORCH_CHECK(false, "peak_loop: this build has no 8-bit integer dot product (it needs AVX2)");
#endif
}

}  // namespace

namespace ember {

// Floating-point operations done (a multiply-add counts 2) by `iterations` rounds of the loop on
// every thread; the caller times the call.
int64_t peak_loop(const std::string& kind, int64_t iterations) {
  TORCH_CHECK(iterations > 0, "peak_loop: iterations must be positive");
  if (kind == "fma") return fma_flops(iterations);
  if (kind == "bf16_dot") return bf16_dot_flops(iterations);
  if (kind == "int8_dot") return int8_dot_ops(iterations);
  TORCH_CHECK(false, "peak_loop: kind must be fma, bf16_dot or int8_dot, got ", kind);
}

}  // namespace ember

// No tensor arguments to dispatch on: one kernel for every key.
TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) { m.def("peak_loop(str kind, int iterations) -> int", &ember::peak_loop); }
