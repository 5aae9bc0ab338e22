// Sixteen floats, one AVX-512 register: helpers shared by the kernels' AVX-512 paths. Everything
// sits in an anonymous namespace: every translation unit keeps its own copy.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include <cstdint>

namespace {

// Lane 4c + l of the result: the sum of acc[4l + c]'s 16 lanes. Every accumulator's lanes are added
// in the same tree (j + 8, then j + 4, then (0 + 2) + (1 + 3)), whichever slot it takes, so an
// output's bits do not depend on the tile around it; 16 sums cost ~30 instructions, not ~16 x 8.
__attribute__((always_inline)) inline __m512 sixteen_sums(const __m512 (&acc)[16]) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int t = 0; t < 8; ++t) {  // [acc[2t] lanes j + (j + 8) | acc[2t + 1] lanes j + (j + 8)], j < 8
    const __m512 low = _mm512_shuffle_f32x4(acc[2 * t], acc[2 * t + 1], 0x44);
    const __m512 high = _mm512_shuffle_f32x4(acc[2 * t], acc[2 * t + 1], 0xEE);
    halves[t] = _mm512_add_ps(low, high);
  }
  for (int t = 0; t < 4; ++t)  // 128-bit chunk c: acc[4t + c] lanes j + (j + 4), j < 4
    quarters[t] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * t], halves[2 * t + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * t], halves[2 * t + 1], 0xDD));
  for (int t = 0; t < 2; ++t)  // chunk c: [q(0 + 2), q(1 + 3)] of quarters[2t] then of quarters[2t + 1]
    pairs[t] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * t], quarters[2 * t + 1], 0x44),
                             _mm512_shuffle_ps(quarters[2 * t], quarters[2 * t + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
}

// Up to 16 bfloat16 values (the first `count`) widened to float32, exactly; the rest zero.
inline __m512 load_bf16_sixteen(const void* p, int64_t count = 16) {
  const __mmask16 valid = count >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, p)), 16));
}

}  // namespace
#endif
