// Decode attention straight out of the paged KV cache: one query token per sequence attends over
// the first context_len tokens its block table points at (a sliding-window layer: the last `window`
// of them). K/V are read in place (no gather copy); scores, softmax and the weighted sum of V are
// computed in float32, scores soft-capped first where the model asks (Gemma 2). A float32 query may
// read a float16 or bfloat16 cache (`--kv-cache-dtype`): half the bytes, widened as they are loaded.
// Any query may read an 8-bit cache (int8 or e4m3 codes with a scale per token and head, kv_quant.h):
// codes are widened as they are loaded, a key's scale multiplies its score and a value's its weight,
// so no float copy of the cache is ever made. Its heads are stored rotated: the query is rotated
// before it meets them and the output rotated back.
//
// Work item = a span of one sequence's tokens, all heads. A sequence is cut into spans by its own
// length alone (64 tokens each; longer ones past 512 tokens, so there are at most 8), never by the
// batch or the thread count, so its output bits depend on its query and K/V only: greedy decoding
// stays independent of batch composition, thread count and block size. The thread that finishes a
// sequence's last span merges them with the usual max/sum rescaling. Threads take items from a
// shared counter, since mixed context lengths make their costs uneven.
//
// Within a span: pass 1 computes the scores of all heads chunk by chunk (kRows rows of one block,
// whose scores fill one vector), a vectorised softmax turns them into weights, pass 2 sums V with
// its accumulators in registers for the whole span. K/V come from memory (a step's caches do not
// fit in any cache) in block-sized pieces scattered over the pool, which the hardware prefetchers
// pick up late: pass 1 prefetches the next chunk's K, and its V for pass 2 (cold caches, 16
// sequences of ~260 tokens: ~25% faster; 1 of ~2,000: ~15%).
// Vectors are GCC/Clang vector extensions of 8 floats, one AVX2 register (AVX-512 machines run the
// same code); loops over the kRows rows of a chunk have constant trip counts, so the row
// accumulators live in registers. A bfloat16 model on a CPU with AVX512-BF16 takes a wider path
// (attend_span_wide): its scores from vdpbf16ps, its sums of V 16 lanes wide. An 8-bit cache on
// AVX-512 widens 16 codes at a time for its scores and its sums of V, and an int8 cache's scores
// are integer dot products with the query as int16 codes (integer_chunk_scores).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kv_quant.h"
#include "ops.h"
#include "vec8.h"
#include "vec16.h"

namespace {

constexpr int64_t kRows = kLanes;  // rows per chunk: their scores are one vector

inline vfloat load(const c10::BFloat16* p) { return load_bf16(p); }

inline vfloat load(const c10::Half* p) {
#if defined(__F16C__)
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vfloat v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline vfloat load(const int8_t* p) {
#if defined(__AVX2__)
  return reinterpret_cast<vfloat>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  vfloat v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = code_value(p[i]);
  return v;
#endif
}

// e4m3 codes as value / 256 (kv_quant.h).
inline vfloat load(const c10::Float8_e4m3fn* p) {
#if defined(__AVX2__) && defined(__F16C__)
  const __m128i codes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x80)), 8),
                                    _mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x7F)), 7));
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(bits));
#else
  vfloat v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = code_value(p[i]);
  return v;
#endif
}

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return code_value(x); }
inline float to_float(c10::Float8_e4m3fn x) { return code_value(x); }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Sums of adjacent pairs, a's and b's interleaved per 128-bit half (vhaddps), of 8 floats or ints.
template <typename V>
inline V pair_sums(V a, V b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane r of the result is the sum of all lanes of v[r].
template <typename V>
inline V transpose_sum(const V (&v)[kRows]) {
  const V low = pair_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
  const V high = pair_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}

inline float max(vfloat v) {
  float m = v[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

struct Shapes {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t row;  // elements of one token's head in the K/V caches: head_dim, and an 8-bit cache's scale
  int64_t block_stride, token_stride;  // in elements, of the K/V caches
};

// Scores of Heads query heads (q, head_dim apart) against a chunk's rows (rows past the chunk's end
// repeat its first row), into scores[h * stride, + kRows). Each key vector is loaded (and widened)
// once for all the heads; each head's sums run in the same order whatever Heads is.
template <int64_t Heads, typename T>
inline void chunk_scores(const float* q, const T* const (&keys)[kRows], int64_t head_dim, float* scores,
                         int64_t stride) {
  vfloat partial[Heads][kRows];
  set_zero(partial);
  int64_t d = 0;
  for (; d + kLanes <= head_dim; d += kLanes) {
    vfloat qv[Heads];
    for (int64_t h = 0; h < Heads; ++h) qv[h] = load(q + h * head_dim + d);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRows; ++r) {
      const vfloat k = load(keys[r] + d);
      for (int64_t h = 0; h < Heads; ++h) partial[h][r] = multiply_add(qv[h], k, partial[h][r]);
    }
  }
  for (int64_t h = 0; h < Heads; ++h) {
    vfloat head_scores = transpose_sum(partial[h]);
    for (int64_t e = d; e < head_dim; ++e)
      for (int64_t r = 0; r < kRows; ++r)
        head_scores[r] = std::fma(q[h * head_dim + e], to_float(keys[r][e]), head_scores[r]);
    store(scores + h * stride, head_scores);
  }
}

// Heads of a group scored together: their accumulators, kRows each, and the key must fit the
// registers (AVX-512's 32 hold 3 heads' 24; AVX2's 16 one head's 8).
#if defined(EMBER_AVX512)
constexpr int64_t kScoredHeadsPerPass = 3;
#else
constexpr int64_t kScoredHeadsPerPass = 1;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
// Sixteen codes of an 8-bit cache (int8, or e4m3 as value / 256), the first `count` of them,
// widened to float32 as they are loaded; the rest read as 0.
inline __m512 widen_sixteen(__m128i codes, int8_t) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)); }

inline __m512 widen_sixteen(__m128i codes, c10::Float8_e4m3fn) {
  const __m256i wide = _mm256_cvtepu8_epi16(codes);
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_cvtph_ps(bits);
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

template <typename T>
inline __m512 load_sixteen(const T* p, int64_t count) {
  return widen_sixteen(_mm_maskz_loadu_epi8(first_lanes(count), p), T{});
}

// chunk_scores for an 8-bit cache, 16 lanes of head_dim at a time: each widened key vector serves
// Heads heads (3 heads' 24 accumulators, their queries and the key fill AVX-512's 32 registers),
// and the lanes are folded to 8 before the rows' sums. Each head's sums run in the same order
// whatever Heads is.
template <int64_t Heads, typename T>
inline void quantized_chunk_scores(const float* q, const T* const (&keys)[kRows], int64_t head_dim, float* scores,
                                   int64_t stride) {
  __m512 partial[Heads][kRows];
  set_zero(partial);
  for (int64_t d = 0; d < head_dim; d += 16) {
    const int64_t count = std::min<int64_t>(16, head_dim - d);
    __m512 qv[Heads];
    for (int64_t h = 0; h < Heads; ++h) qv[h] = _mm512_maskz_loadu_ps(first_lanes(count), q + h * head_dim + d);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 k = load_sixteen(keys[r] + d, count);
      for (int64_t h = 0; h < Heads; ++h) partial[h][r] = _mm512_fmadd_ps(qv[h], k, partial[h][r]);
    }
  }
  for (int64_t h = 0; h < Heads; ++h) {
    vfloat folded[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 x = partial[h][r];
      folded[r] = reinterpret_cast<vfloat>(_mm256_add_ps(
          _mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
    }
    store(scores + h * stride, transpose_sum(folded));
  }
}
#define EMBER_WIDE_CODES 1

#if defined(__AVX512VNNI__)
// An int8 cache's scores in integers. The query comes as int16 codes with a scale per head (15
// bits: far finer than a bfloat16 query's own rounding), rows padded with zeros to 32 codes;
// vpdpwssd sums 32 code products an instruction into int32 lanes (|sum| < 2^31 for head_dim
// <= 512), so a score is exact whatever the order, and costs a third of widening every key
// code to float32.
constexpr int64_t kCodePairs = 32;

inline int64_t padded_codes(int64_t head_dim) { return (head_dim + kCodePairs - 1) / kCodePairs * kCodePairs; }

template <int64_t Heads>
inline void integer_chunk_scores(const int16_t* q, const float* q_scales, const int8_t* const (&keys)[kRows],
                                 int64_t head_dim, float* scores, int64_t stride) {
  const int64_t q_stride = padded_codes(head_dim);
  __m512i partial[Heads][kRows];
  for (auto& row : partial)
    for (auto& lane : row) lane = _mm512_setzero_si512();
  for (int64_t d = 0; d < head_dim; d += kCodePairs) {
    const int64_t count = std::min(kCodePairs, head_dim - d);
    const __mmask32 valid = count == kCodePairs ? ~__mmask32(0) : static_cast<__mmask32>((1u << count) - 1);
    __m512i qv[Heads];
    for (int64_t h = 0; h < Heads; ++h) qv[h] = _mm512_loadu_si512(q + h * q_stride + d);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512i k = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(valid, keys[r] + d));
      for (int64_t h = 0; h < Heads; ++h) partial[h][r] = _mm512_dpwssd_epi32(partial[h][r], qv[h], k);
    }
  }
  for (int64_t h = 0; h < Heads; ++h) {
    vint folded[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      folded[r] = reinterpret_cast<vint>(
          _mm256_add_epi32(_mm512_castsi512_si256(partial[h][r]), _mm512_extracti64x4_epi64(partial[h][r], 1)));
    const vfloat sums = __builtin_convertvector(transpose_sum(folded), vfloat);
    store(scores + h * stride, sums * q_scales[h]);
  }
}

// Scores of every query head of kv head kv's group against a chunk of an int8 cache.
inline void integer_group_chunk_scores(const int16_t* q, const float* q_scales, const int8_t* const (&keys)[kRows],
                                       const Shapes& s, int64_t kv, float* scores, int64_t stride) {
  const int64_t q_stride = padded_codes(s.head_dim);
  for (int64_t h = kv * s.group; h < (kv + 1) * s.group; h += kScoredHeadsPerPass) {
    const int16_t* head_q = q + h * q_stride;
    float* head_scores = scores + h * stride;
    switch (std::min(kScoredHeadsPerPass, (kv + 1) * s.group - h)) {
      case 1: integer_chunk_scores<1>(head_q, q_scales + h, keys, s.head_dim, head_scores, stride); break;
      case 2: integer_chunk_scores<2>(head_q, q_scales + h, keys, s.head_dim, head_scores, stride); break;
      default: integer_chunk_scores<kScoredHeadsPerPass>(head_q, q_scales + h, keys, s.head_dim, head_scores, stride);
    }
  }
}

// The scaled float32 query as int16 codes and a scale per head (absmax / 32767), rows padded with zeros.
inline void quantize_query(const float* q, const Shapes& s, int16_t* codes, float* scales) {
  const int64_t q_stride = padded_codes(s.head_dim);
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const float* row = q + h * s.head_dim;
    float absmax = 0.0f;
    for (int64_t d = 0; d < s.head_dim; ++d) absmax = std::max(absmax, std::fabs(row[d]));
    scales[h] = absmax / 32767.0f;
    const float inverse = absmax > 0.0f ? 32767.0f / absmax : 0.0f;
    int16_t* out = codes + h * q_stride;
    for (int64_t d = 0; d < s.head_dim; ++d) out[d] = static_cast<int16_t>(std::nearbyint(row[d] * inverse));
    std::fill(out + s.head_dim, out + q_stride, int16_t{0});
  }
}
#define EMBER_INTEGER_SCORES 1
#endif
#endif

// Scores of Heads query heads against a chunk, on the widest path built for the cache's dtype.
template <int64_t Heads, typename T>
inline void heads_chunk_scores(const float* q, const T* const (&keys)[kRows], int64_t head_dim, float* scores,
                               int64_t stride) {
#if defined(EMBER_WIDE_CODES)
  if constexpr (kQuantizedCache<T>) {
    quantized_chunk_scores<Heads>(q, keys, head_dim, scores, stride);
    return;
  }
#endif
  chunk_scores<Heads>(q, keys, head_dim, scores, stride);
}

// Scores of every query head of kv head kv's group against a chunk.
template <typename T>
inline void group_chunk_scores(const float* q, const T* const (&keys)[kRows], const Shapes& s, int64_t kv,
                               float* scores, int64_t stride) {
  for (int64_t h = kv * s.group; h < (kv + 1) * s.group; h += kScoredHeadsPerPass) {
    const float* head_q = q + h * s.head_dim;
    float* head_scores = scores + h * stride;
    switch (std::min(kScoredHeadsPerPass, (kv + 1) * s.group - h)) {
      case 1: heads_chunk_scores<1>(head_q, keys, s.head_dim, head_scores, stride); break;
      case 2: heads_chunk_scores<2>(head_q, keys, s.head_dim, head_scores, stride); break;
      default: heads_chunk_scores<kScoredHeadsPerPass>(head_q, keys, s.head_dim, head_scores, stride);
    }
  }
}

// The first position a query at position context_len - 1 attends to: a sliding window of `window`
// tokens sees p - window < q <= p (window 0: every position).
inline int64_t window_start(int64_t context_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
}

// Tokens [begin, end) of one sequence's context.
struct Span {
  int64_t sequence, begin, end;
};

// Calls f(t, offset of token t in a cache) for the span's tokens in order, a block at a time, so
// the per-token work has no division.
template <typename F>
inline void for_each_token(const Span& span, const int32_t* block_table, const Shapes& s, F&& f) {
  for (int64_t t = span.begin; t < span.end;) {
    const int64_t in_block = t % s.block_size, run = std::min(span.end - t, s.block_size - in_block);
    int64_t offset = block_table[t / s.block_size] * s.block_stride + in_block * s.token_stride;
    for (const int64_t end = t + run; t < end; ++t, offset += s.token_stride) f(t, offset);
  }
}

// acc[g][0, kLanes * Vectors) += weight[g][t] * V[t][d, d + kLanes * Vectors) over a span's tokens in order, for
// Heads heads of a kv head's group. The accumulators stay in registers for the whole span: a token costs
// Vectors loads of V and Heads * Vectors independent FMAs. Each lane sums its tokens in order, so
// the bits do not depend on how blocks cut the span.
template <typename T, int64_t Heads, int64_t Vectors>
inline void accumulate_value_slice(float* acc, const float* weights, const T* values, const int32_t* block_table,
                                   const Span& span, const Shapes& s, int64_t weight_stride) {
  vfloat a[Heads][Vectors];
  set_zero(a);
  for_each_token(span, block_table, s, [&](int64_t t, int64_t offset) {
    vfloat v[Vectors];
    for (int64_t j = 0; j < Vectors; ++j) v[j] = load(values + offset + j * kLanes);
    for (int64_t g = 0; g < Heads; ++g) {
      const vfloat w = broadcast(weights[g * weight_stride + (t - span.begin)]);
      for (int64_t j = 0; j < Vectors; ++j) a[g][j] = multiply_add(w, v[j], a[g][j]);
    }
  });
  for (int64_t g = 0; g < Heads; ++g)
    for (int64_t j = 0; j < Vectors; ++j) store(acc + g * s.head_dim + j * kLanes, a[g][j]);
}

// Up to kHeadsPerPass heads of a group over 4-vector slices of head_dim, then single vectors and
// single values: at most 12 accumulators, which leaves an AVX2 machine's 16 registers room for V and
// the weight.
template <typename T, int64_t Heads>
inline void accumulate_values_of_heads(float* acc, const float* weights, const T* values, const int32_t* block_table,
                                       const Span& span, const Shapes& s, int64_t weight_stride) {
  constexpr int64_t kWideVectors = 4;
  int64_t d = 0;
  for (; d + kWideVectors * kLanes <= s.head_dim; d += kWideVectors * kLanes)
    accumulate_value_slice<T, Heads, kWideVectors>(acc + d, weights, values + d, block_table, span, s, weight_stride);
  for (; d + kLanes <= s.head_dim; d += kLanes)
    accumulate_value_slice<T, Heads, 1>(acc + d, weights, values + d, block_table, span, s, weight_stride);
  for (; d < s.head_dim; ++d) {
    for (int64_t g = 0; g < Heads; ++g) acc[g * s.head_dim + d] = 0.0f;
    for_each_token(span, block_table, s, [&](int64_t t, int64_t offset) {
      const float v = to_float(values[offset + d]);
      for (int64_t g = 0; g < Heads; ++g)
        acc[g * s.head_dim + d] = std::fma(weights[g * weight_stride + (t - span.begin)], v, acc[g * s.head_dim + d]);
    });
  }
}

constexpr int64_t kHeadsPerPass = 3;

// acc[g] = sum over the span's tokens t of weight[g][t] * V[t], for every query head g of kv head kv's group.
template <typename T>
inline void accumulate_values(float* acc, const float* weights, const T* value_cache, const int32_t* block_table,
                              const Span& span, const Shapes& s, int64_t kv, int64_t weight_stride) {
  const T* values = value_cache + kv * s.row;
  for (int64_t g = 0; g < s.group; g += kHeadsPerPass) {
    float* head_acc = acc + g * s.head_dim;
    const float* head_weights = weights + g * weight_stride;
    switch (std::min(kHeadsPerPass, s.group - g)) {
      case 1: accumulate_values_of_heads<T, 1>(head_acc, head_weights, values, block_table, span, s, weight_stride); break;
      case 2: accumulate_values_of_heads<T, 2>(head_acc, head_weights, values, block_table, span, s, weight_stride); break;
      default: accumulate_values_of_heads<T, 3>(head_acc, head_weights, values, block_table, span, s, weight_stride);
    }
  }
}

// Gemma 2's soft-capped attention logits, cap * tanh(score / cap), in place (cap 0: none).
inline void soft_cap(float* row, int64_t length, float cap) {
  if (cap <= 0.0f) return;
  int64_t t = 0;
  for (; t + kLanes <= length; t += kLanes) store(row + t, tanh_vector(load(row + t) / cap) * cap);
  for (; t < length; ++t) row[t] = tanh_vector(broadcast(row[t] / cap))[0] * cap;
}

// Turns a row of scores into exp(score - max) in place; returns the max and the sum.
inline std::pair<float, float> softmax_weights(float* row, int64_t length) {
  vfloat vmax = broadcast(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= length; t += kLanes) {
    const vfloat x = load(row + t);
    vmax = x > vmax ? x : vmax;
  }
  float max_score = max(vmax);
  for (int64_t i = t; i < length; ++i) max_score = std::max(max_score, row[i]);
  vfloat vsum{};
  for (t = 0; t + kLanes <= length; t += kLanes) {
    const vfloat w = exp_nonpositive(load(row + t) - max_score);
    store(row + t, w);
    vsum += w;
  }
  float total = sum(vsum);
  for (; t < length; ++t) {
    row[t] = exp_nonpositive(broadcast(row[t] - max_score))[0];
    total += row[t];
  }
  return {max_score, total};
}

// Per query head of a span: max score, sum of exp(score - max), and the weighted sum of V.
struct Partial {
  float* max;  // [num_heads]
  float* sum;  // [num_heads]
  float* acc;  // [num_heads, head_dim]
};

// Per-thread float32 buffer: the scores (then weights) of every head over a span with a chunk of
// slack (a chunk's scores are stored whole, 16 on the bfloat16 path).
constexpr int64_t kScoreSlack = 16;

struct Scratch {
  int64_t score_stride;
  std::vector<float> scores;
  Scratch(const Shapes& s, int64_t max_span) : score_stride(max_span + kScoreSlack), scores(s.num_heads * score_stride) {}
};

// Every sequence's query as attend_span reads it, made once before the spans are shared out (a
// prompt chunk's tokens are sequences of up to 8 spans each, and each span would redo it): float32
// times the scale, rotated for an 8-bit cache (kv_quant.h: Hq.Hk = q.k), and for an int8 cache its
// int16 codes too (integer_chunk_scores).
struct Queries {
  std::vector<float> values;  // [batch, num_heads, head_dim]
  std::vector<int16_t> codes;  // [batch, num_heads, padded_codes(head_dim)]
  std::vector<float> code_scales;  // [batch, num_heads]
};

template <typename Q, typename T>
Queries prepare_queries(const Q* query, int64_t batch, int64_t batch_stride, const Shapes& s, float scale) {
  const int64_t width = s.num_heads * s.head_dim;
  Queries queries;
  queries.values.resize(batch * width);
#if defined(EMBER_INTEGER_SCORES)
  constexpr bool kCoded = std::is_same_v<T, int8_t>;
  const int64_t coded_width = s.num_heads * padded_codes(s.head_dim);
  if constexpr (kCoded) {
    queries.codes.resize(batch * coded_width);
    queries.code_scales.resize(batch * s.num_heads);
  }
#endif
  at::parallel_for(0, batch, 16, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      float* q = &queries.values[b * width];
      for (int64_t i = 0; i < width; ++i) q[i] = to_float(query[b * batch_stride + i]) * scale;
      if constexpr (kQuantizedCache<T>)
        for (int64_t h = 0; h < s.num_heads; ++h) rotate_row(q + h * s.head_dim, s.head_dim);
#if defined(EMBER_INTEGER_SCORES)
      if constexpr (kCoded) quantize_query(q, s, &queries.codes[b * coded_width], &queries.code_scales[b * s.num_heads]);
#endif
    }
  });
  return queries;
}

// The chunk starting at token t: at most kRows rows, never past the span or its block. Offsets
// of rows past the chunk's end repeat its first row, so every load stays inside the cache.
template <int64_t Rows = kRows>
struct Chunk {
  int64_t rows, offsets[Rows];
};

template <int64_t Rows = kRows>
inline Chunk<Rows> chunk_at(int64_t t, int64_t end, const int32_t* block_table, const Shapes& s) {
  const int64_t in_block = t % s.block_size;
  Chunk<Rows> chunk;
  chunk.rows = std::min({Rows, end - t, s.block_size - in_block});
  const int64_t base = block_table[t / s.block_size] * s.block_stride + in_block * s.token_stride;
  for (int64_t r = 0; r < Rows; ++r) chunk.offsets[r] = base + (r < chunk.rows ? r : 0) * s.token_stride;
  return chunk;
}

// A chunk's K into L1 and its V into L2, where pass 2 finds it.
template <typename T, int64_t Rows>
inline void prefetch_chunk(const T* key_cache, const T* value_cache, const Chunk<Rows>& chunk, const Shapes& s) {
  const char* keys = reinterpret_cast<const char*>(key_cache + chunk.offsets[0]);
  const char* values = reinterpret_cast<const char*>(value_cache + chunk.offsets[0]);
  const int64_t bytes = chunk.rows * s.token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(keys + b);
    __builtin_prefetch(values + b, 0, 2);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
// V summed 16 lanes wide on AVX-512: bfloat16 values, and an 8-bit cache's codes (int8, or e4m3 as
// value / 256), widened as they are loaded. Each output lane sums its tokens in order.
inline __m512 load_sixteen(const c10::BFloat16* p, int64_t count) { return load_bf16_sixteen(p, count); }

// acc[g] = sum over the span's tokens t of weight[g][t] * V[t], for Heads heads, 64 lanes of
// head_dim at a time (4 registers a head: 3 heads' 12 accumulators, 4 of V and a weight).
template <int64_t Heads, typename T>
inline void wide_accumulate_values(float* acc, const float* weights, const T* values,
                                   const int32_t* block_table, const Span& span, const Shapes& s,
                                   int64_t weight_stride) {
  constexpr int64_t kVectors = 4, kWidth = 16;
  for (int64_t d = 0; d < s.head_dim; d += kVectors * kWidth) {
    __m512 a[Heads][kVectors];
    set_zero(a);
    int64_t counts[kVectors];
    for (int64_t j = 0; j < kVectors; ++j) counts[j] = std::clamp<int64_t>(s.head_dim - d - j * kWidth, 0, kWidth);
    for_each_token(span, block_table, s, [&](int64_t t, int64_t offset) {
      __m512 v[kVectors];
      for (int64_t j = 0; j < kVectors; ++j) v[j] = load_sixteen(values + offset + d + j * kWidth, counts[j]);
      for (int64_t g = 0; g < Heads; ++g) {
        const __m512 w = _mm512_set1_ps(weights[g * weight_stride + (t - span.begin)]);
        for (int64_t j = 0; j < kVectors; ++j) a[g][j] = _mm512_fmadd_ps(w, v[j], a[g][j]);
      }
    });
    for (int64_t g = 0; g < Heads; ++g)
      for (int64_t j = 0; j < kVectors; ++j)
        if (counts[j] > 0)
          _mm512_mask_storeu_ps(acc + g * s.head_dim + d + j * kWidth, static_cast<__mmask16>((1u << counts[j]) - 1),
                                a[g][j]);
  }
}

// acc[g] = sum over the span's tokens t of weight[g][t] * V[t], for every query head g of kv head kv's group.
template <typename T>
inline void wide_accumulate_group_values(float* acc, const float* weights, const T* value_cache,
                                         const int32_t* block_table, const Span& span, const Shapes& s, int64_t kv,
                                         int64_t weight_stride) {
  const T* values = value_cache + kv * s.row;
  for (int64_t g = 0; g < s.group; g += kHeadsPerPass) {
    float* head_acc = acc + g * s.head_dim;
    const float* head_weights = weights + g * weight_stride;
    switch (std::min(kHeadsPerPass, s.group - g)) {
      case 1: wide_accumulate_values<1>(head_acc, head_weights, values, block_table, span, s, weight_stride); break;
      case 2: wide_accumulate_values<2>(head_acc, head_weights, values, block_table, span, s, weight_stride); break;
      default: wide_accumulate_values<3>(head_acc, head_weights, values, block_table, span, s, weight_stride);
    }
  }
}
#define EMBER_WIDE_VALUES 1
#endif

// An 8-bit cache's key scales times a chunk's scores of kv head kv's group, row by row.
template <typename T>
inline void scale_chunk_scores(const T* const (&keys)[kRows], const Shapes& s, int64_t kv, float* scores,
                               int64_t stride) {
  vfloat key_scales;
  for (int64_t r = 0; r < kRows; ++r) key_scales[r] = row_scale(keys[r], s.head_dim);
  for (int64_t h = kv * s.group; h < (kv + 1) * s.group; ++h) store(scores + h * stride, load(scores + h * stride) * key_scales);
}

// An 8-bit cache's value scales times the span's softmax weights (after their sum is taken), so
// pass 2 sums codes as it sums values.
template <typename T>
inline void scale_weights(const T* value_cache, const int32_t* block_table, const Span& span, const Shapes& s,
                          float* weights, int64_t stride) {
  for (int64_t kv = 0; kv < s.num_kv_heads; ++kv)
    for_each_token(span, block_table, s, [&](int64_t t, int64_t offset) {
      const float value_scale = row_scale(value_cache + offset + kv * s.row, s.head_dim);
      for (int64_t h = kv * s.group; h < (kv + 1) * s.group; ++h) weights[h * stride + (t - span.begin)] *= value_scale;
    });
}

template <typename T>
void attend_span(const Queries& queries, const T* key_cache, const T* value_cache, const int32_t* block_table,
                 const Span& span, const Shapes& s, float softcap, Scratch& scratch, const Partial& result) {
  const int64_t group = s.group, head_dim = s.head_dim, stride = scratch.score_stride;
  const int64_t b = span.sequence;
  const float* q = &queries.values[b * s.num_heads * head_dim];
  float* scores = scratch.scores.data();

  for (int64_t t = span.begin, rows = 0; t < span.end; t += rows) {
    const Chunk chunk = chunk_at(t, span.end, block_table, s);
    rows = chunk.rows;
    if (t == span.begin) prefetch_chunk(key_cache, value_cache, chunk, s);
    if (t + rows < span.end) prefetch_chunk(key_cache, value_cache, chunk_at(t + rows, span.end, block_table, s), s);
    for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
      const T* keys[kRows];
      for (int64_t r = 0; r < kRows; ++r) keys[r] = key_cache + chunk.offsets[r] + kv * s.row;
#if defined(EMBER_INTEGER_SCORES)
      if constexpr (std::is_same_v<T, int8_t>)
        integer_group_chunk_scores(&queries.codes[b * s.num_heads * padded_codes(head_dim)],
                                   &queries.code_scales[b * s.num_heads], keys, s, kv, scores + (t - span.begin), stride);
      else
#endif
        group_chunk_scores(q, keys, s, kv, scores + (t - span.begin), stride);
      if constexpr (kQuantizedCache<T>) scale_chunk_scores(keys, s, kv, scores + (t - span.begin), stride);
    }
  }

  for (int64_t h = 0; h < s.num_heads; ++h) {
    soft_cap(scores + h * stride, span.end - span.begin, softcap);
    std::tie(result.max[h], result.sum[h]) = softmax_weights(scores + h * stride, span.end - span.begin);
  }
  if constexpr (kQuantizedCache<T>) scale_weights(value_cache, block_table, span, s, scores, stride);

  for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
#if defined(EMBER_WIDE_VALUES)
    if constexpr (kQuantizedCache<T>) {
      wide_accumulate_group_values(result.acc + kv * group * head_dim, scores + kv * group * stride, value_cache,
                                   block_table, span, s, kv, stride);
      continue;
    }
#endif
    accumulate_values(result.acc + kv * group * head_dim, scores + kv * group * stride, value_cache, block_table, span,
                      s, kv, stride);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// A bfloat16 query over a bfloat16 cache, on CPUs with AVX512-BF16: a score is the query's dot
// product with a key row straight from their bfloat16 values, 32 products an instruction
// (vdpbf16ps; each product of two bfloat16 values is exact in float32), times the scale; V is
// summed 16 lanes wide. Chunks are 16 rows, a score per lane. As on the float32 path, a score reads
// only its query and key row and each output lane sums its tokens in order, so the bits depend on
// the sequence alone.
constexpr int64_t kWideRows = 16;
constexpr int64_t kPairsPerStep = 32;  // bfloat16 values of one register

inline __m512bh load_pairs(const c10::BFloat16* p, __mmask32 valid) {
  return (__m512bh)_mm512_maskz_loadu_epi16(valid, p);
}

// Scores of one query head against a chunk's 16 rows, lane r for row r.
inline __m512 wide_chunk_scores(const c10::BFloat16* q, const c10::BFloat16* const (&keys)[kWideRows],
                                int64_t head_dim, float scale) {
  // sixteen_sums puts slot 4l + c's sum in lane 4c + l: row r goes to slot 4 (r % 4) + r / 4.
  __m512 acc[kWideRows];
  set_zero(acc);
  for (int64_t d = 0; d < head_dim; d += kPairsPerStep) {
    const int64_t count = std::min(kPairsPerStep, head_dim - d);
    const __mmask32 valid = count == kPairsPerStep ? ~__mmask32(0) : static_cast<__mmask32>((1u << count) - 1);
    const __m512bh qv = load_pairs(q + d, valid);
    for (int64_t r = 0; r < kWideRows; ++r) {
      __m512& a = acc[4 * (r % 4) + r / 4];
      a = _mm512_dpbf16_ps(a, qv, load_pairs(keys[r] + d, valid));
    }
  }
  return _mm512_mul_ps(sixteen_sums(acc), _mm512_set1_ps(scale));
}

void attend_span_wide(const c10::BFloat16* query, const c10::BFloat16* key_cache, const c10::BFloat16* value_cache,
                      const int32_t* block_table, const Span& span, const Shapes& s, float scale, float softcap,
                      Scratch& scratch, const Partial& result) {
  const int64_t group = s.group, head_dim = s.head_dim, stride = scratch.score_stride;
  float* scores = scratch.scores.data();
  for (int64_t t = span.begin, rows = 0; t < span.end; t += rows) {
    const Chunk<kWideRows> chunk = chunk_at<kWideRows>(t, span.end, block_table, s);
    rows = chunk.rows;
    if (t == span.begin) prefetch_chunk(key_cache, value_cache, chunk, s);
    if (t + rows < span.end)
      prefetch_chunk(key_cache, value_cache, chunk_at<kWideRows>(t + rows, span.end, block_table, s), s);
    for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
      const c10::BFloat16* keys[kWideRows];
      for (int64_t r = 0; r < kWideRows; ++r) keys[r] = key_cache + chunk.offsets[r] + kv * s.row;
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
        _mm512_storeu_ps(scores + h * stride + (t - span.begin), wide_chunk_scores(query + h * head_dim, keys, head_dim, scale));
    }
  }

  for (int64_t h = 0; h < s.num_heads; ++h) {
    soft_cap(scores + h * stride, span.end - span.begin, softcap);
    std::tie(result.max[h], result.sum[h]) = softmax_weights(scores + h * stride, span.end - span.begin);
  }

  for (int64_t kv = 0; kv < s.num_kv_heads; ++kv)
    wide_accumulate_group_values(result.acc + kv * group * head_dim, scores + kv * group * stride, value_cache,
                                 block_table, span, s, kv, stride);
}
#define EMBER_WIDE_BF16_ATTENTION 1
#endif

// Output of one sequence from its spans' partials, rescaled to a common max; over an 8-bit cache,
// whose values are rotated (kv_quant.h), rotated back: H sum(p Hv) = sum(p v). `factors` is
// scratch with room for one float per span, `head` for one head's output.
template <typename T>
void merge_spans(const std::vector<float>& maxes, const std::vector<float>& sums, const std::vector<float>& accs,
                 int64_t first_span, int64_t num_spans, const Shapes& s, bool rotated, float* factors, float* head,
                 T* out) {
  const int64_t num_heads = s.num_heads, head_dim = s.head_dim;
  for (int64_t h = 0; h < num_heads; ++h) {
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < num_spans; ++i) max_score = std::max(max_score, maxes[(first_span + i) * num_heads + h]);
    float total = 0.0f;
    for (int64_t i = 0; i < num_spans; ++i) {
      const int64_t at = (first_span + i) * num_heads + h;
      factors[i] = std::exp(maxes[at] - max_score);
      total += sums[at] * factors[i];
    }
    for (int64_t i = 0; i < num_spans; ++i) factors[i] /= total;
    const float* head_accs = &accs[(first_span * num_heads + h) * head_dim];
    const int64_t span_stride = num_heads * head_dim;
    int64_t d = 0;
    for (; d + kLanes <= head_dim; d += kLanes) {
      vfloat value{};
      for (int64_t i = 0; i < num_spans; ++i)
        value = multiply_add(load(head_accs + i * span_stride + d), broadcast(factors[i]), value);
      store(head + d, value);
    }
    for (; d < head_dim; ++d) {
      float value = 0.0f;
      for (int64_t i = 0; i < num_spans; ++i) value = std::fma(head_accs[i * span_stride + d], factors[i], value);
      head[d] = value;
    }
    if (rotated) rotate_row(head, head_dim);
    for (d = 0; d < head_dim; ++d) out[h * head_dim + d] = static_cast<T>(head[d]);
  }
}

template <typename Q, typename T>
void run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, float softcap,
         int64_t window, at::Tensor& out, const Shapes& s) {
  const int64_t batch = query.size(0), num_heads = s.num_heads, head_dim = s.head_dim;
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const Q* q = query.data_ptr<Q>();
  const T* k = key_cache.data_ptr<T>();
  const T* v = value_cache.data_ptr<T>();
  Q* o = out.data_ptr<Q>();

  // Spans of kSpanTokens give two or more threads work from 65 tokens on; longer contexts take
  // longer spans, since each has a fixed cost (query, softmax, merge).
  constexpr int64_t kSpanTokens = 64, kMaxSpansPerSequence = 8;
  const int64_t num_threads = at::get_num_threads();
  std::vector<Span> spans;
  std::vector<int64_t> first_span(batch + 1);
  int64_t longest_span = 0;
  for (int64_t b = 0; b < batch; ++b) {
    first_span[b] = static_cast<int64_t>(spans.size());
    const int64_t start = window_start(lens[b], window), length = lens[b] - start;
    const int64_t span_tokens =
        kSpanTokens * std::max<int64_t>(1, (length + kSpanTokens * kMaxSpansPerSequence - 1) /
                                               (kSpanTokens * kMaxSpansPerSequence));
    for (int64_t begin = start; begin < lens[b]; begin += span_tokens)
      spans.push_back({b, begin, std::min<int64_t>(begin + span_tokens, lens[b])});
    longest_span = std::max(longest_span, std::min<int64_t>(span_tokens, length));
  }
  first_span[batch] = static_cast<int64_t>(spans.size());
  const int64_t num_spans = first_span[batch];
  std::vector<float> maxes(num_spans * num_heads), sums(num_spans * num_heads), accs(num_spans * num_heads * head_dim);

  // The worker that finishes a sequence's last span writes its output, so no second pass is needed.
  std::vector<std::atomic<int64_t>> spans_left(batch);
  int64_t max_spans_per_sequence = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = first_span[b + 1] - first_span[b];
    spans_left[b].store(count, std::memory_order_relaxed);
    max_spans_per_sequence = std::max(max_spans_per_sequence, count);
    if (count == 0) std::fill(o + b * num_heads * head_dim, o + (b + 1) * num_heads * head_dim, static_cast<Q>(0.0f));
  }

#if defined(EMBER_WIDE_BF16_ATTENTION)
  constexpr bool kWide = std::is_same_v<Q, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kWide = false;
#endif
  const Queries queries = kWide ? Queries{} : prepare_queries<Q, T>(q, batch, query.stride(0), s, scale);
  std::atomic<int64_t> next_span{0};
  at::parallel_for(0, std::min(num_threads, num_spans), 1, [&](int64_t, int64_t) {
    Scratch scratch(s, longest_span);
    std::vector<float> factors(max_spans_per_sequence), head(head_dim);
    for (int64_t i = next_span++; i < num_spans; i = next_span++) {
      const int64_t b = spans[i].sequence;
      const Partial result{&maxes[i * num_heads], &sums[i * num_heads], &accs[i * num_heads * head_dim]};
#if defined(EMBER_WIDE_BF16_ATTENTION)
      if constexpr (kWide)
        attend_span_wide(q + b * query.stride(0), k, v, tables + b * s.max_blocks, spans[i], s, scale, softcap,
                         scratch, result);
      else
#endif
        attend_span(queries, k, v, tables + b * s.max_blocks, spans[i], s, softcap, scratch, result);
      if (spans_left[b].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge_spans(maxes, sums, accs, first_span[b], first_span[b + 1] - first_span[b], s, kQuantizedCache<T>,
                    factors.data(), head.data(), o + b * num_heads * head_dim);
    }
  });
}

// Query / cache dtype pairs the kernel is built for: a float32 model may keep a half-size cache, and
// any model an 8-bit one.
bool supports(at::ScalarType query, at::ScalarType cache) {
  if ((query == at::kFloat || query == at::kBFloat16 || query == at::kHalf) && is_quantized_cache(cache)) return true;
  if (query == at::kFloat) return cache == at::kFloat || cache == at::kHalf || cache == at::kBFloat16;
  return (query == at::kBFloat16 || query == at::kHalf) && cache == query;
}

}  // namespace

namespace ember {

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, double softcap, int64_t window) {
  TORCH_CHECK(query.dim() == 3, "paged_decode_attention: query must be [batch, heads, head_dim], got ",
              query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "paged_decode_attention: key_cache and value_cache must both be "
              "[num_blocks, block_size, kv_heads, head_dim], got ", key_cache.sizes(), " and ",
              value_cache.sizes());
  const auto dtype = query.scalar_type(), cache_dtype = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == cache_dtype, "paged_decode_attention: key_cache and value_cache must share a dtype, got ",
              cache_dtype, " and ", value_cache.scalar_type());
  TORCH_CHECK(supports(dtype, cache_dtype),
              "paged_decode_attention: supports a float32 query over a float32, float16 or bfloat16 cache, a "
              "bfloat16 or float16 query over a cache of its dtype, and any of them over an int8 or e4m3 cache; got a ",
              dtype, " query over a ", cache_dtype, " cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and context_lens must be int32, got ",
              block_tables.scalar_type(), " and ", context_lens.scalar_type());
  TORCH_CHECK(query.is_cpu() && key_cache.is_cpu() && value_cache.is_cpu() && block_tables.is_cpu() &&
                  context_lens.is_cpu(),
              "paged_decode_attention: all tensors must be on the CPU");
  // The query's rows may be strided (the q columns of a fused QKV output), its heads not.
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_decode_attention: each query row's heads must be contiguous, got strides ", query.strides());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && block_tables.is_contiguous() &&
                  context_lens.is_contiguous(),
              "paged_decode_attention: the caches, block_tables and context_lens must be contiguous");

  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t row = head_dim + (is_quantized_cache(cache_dtype) ? kScaleBytes : 0);
  TORCH_CHECK(key_cache.size(3) == row, "paged_decode_attention: the cache's rows hold ", key_cache.size(3),
              " elements, a query head_dim of ", head_dim, " needs ", row,
              is_quantized_cache(cache_dtype) ? " (its values and their float16 scale)" : "");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_decode_attention: ", num_heads,
              " query heads are not a multiple of ", num_kv_heads, " kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch,
              "paged_decode_attention: block_tables must be [batch, max_blocks], got ", block_tables.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == batch,
              "paged_decode_attention: context_lens must be [batch], got ", context_lens.sizes());

  TORCH_CHECK(softcap >= 0.0 && window >= 0, "paged_decode_attention: softcap and window must be >= 0 (0: none), got ",
              softcap, " and ", window);
  // A bad block id or length would read outside the cache; checking is O(batch * max_blocks). Only
  // the blocks of the window are read: a sliding window's table may hold dropped (-1) entries before it.
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size, "paged_decode_attention: context_lens[",
                b, "] = ", lens[b], " does not fit ", max_blocks, " blocks of ", block_size);
    for (int64_t i = window_start(lens[b], window) / block_size; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int32_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block_tables[", b, ", ", i,
                  "] = ", block, " is outside the cache's ", num_blocks, " blocks");
    }
  }

  at::Tensor out = at::empty(query.sizes(), query.options());
  const Shapes shapes{num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim, block_size, max_blocks, row,
                      block_size * num_kv_heads * row, num_kv_heads * row};
  const float scale_f = static_cast<float>(scale), softcap_f = static_cast<float>(softcap);
  const auto attend = [&](auto query_type, auto cache_type) {
    run<decltype(query_type), decltype(cache_type)>(query, key_cache, value_cache, block_tables, context_lens, scale_f,
                                                    softcap_f, window, out, shapes);
  };
  const auto attend_quantized = [&](auto query_type) {
    if (cache_dtype == at::kChar)
      attend(query_type, int8_t{});
    else
      attend(query_type, c10::Float8_e4m3fn{});
  };
  if (is_quantized_cache(cache_dtype)) {
    if (dtype == at::kBFloat16)
      attend_quantized(c10::BFloat16{});
    else if (dtype == at::kHalf)
      attend_quantized(c10::Half{});
    else
      attend_quantized(float{});
  } else if (dtype == at::kBFloat16)
    attend(c10::BFloat16{}, c10::BFloat16{});
  else if (dtype == at::kHalf)
    attend(c10::Half{}, c10::Half{});
  else if (cache_dtype == at::kHalf)
    attend(float{}, c10::Half{});
  else if (cache_dtype == at::kBFloat16)
    attend(float{}, c10::BFloat16{});
  else
    attend(float{}, float{});
  return out;
}

}  // namespace ember

TORCH_LIBRARY(EMBER_OPS, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, float softcap=0., int window=0) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("paged_decode_attention_supports(ScalarType query, ScalarType cache) -> bool", &supports);
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("paged_decode_attention", &ember::paged_decode_attention); }
