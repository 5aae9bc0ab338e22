// y = x W^T + b for the few rows of a decode step (float32, CPU), reading W once, in place.
//
// At decode batch sizes the weights do not fit in any cache and every step streams all of them
// from memory, so the product is bound by memory bandwidth (batch 1) or by how well the loads
// overlap the FMAs (batch 16). BLAS sgemm repacks W on every call, which costs more than the
// product at these sizes. Here a thread takes a tile of kTileRows rows of W and, while the tile
// sits in L1, computes its dot products with every row of x, a few x rows at a time so the
// accumulators stay in registers. The weights stay in nn.Linear's [out, in] layout: no second
// copy. Larger batches (prefill) go to torch's GEMM, which is faster there.
//
// The same tiles can come from GGUF quantized blocks (Q4_0 to Q8_0, Q2_K to Q6_K, IQ4_NL, IQ4_XS; gguf_blocks.h)
// instead: each thread expands a tile into float32 in L1, with exactly the values gguf-py's
// dequantization gives, and runs the same dot products. The products are then bit-identical to the
// float32 weights', while a step reads 4-7x fewer bytes from memory.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "gguf_blocks.h"
#include "ops.h"
#include "parallel_tiles.h"
#include "vec8.h"

namespace {

constexpr int64_t kTileRows = 4;

// v, held in a register. Left alone, GCC folds the x loads of a tile into its FMAs and reloads
// them for every weight row: 16 loads per 12 FMAs for a 3x4 tile, so the loads bound it. Held, a
// tile step is 7 loads and 12 FMAs (measured 15-20% faster at 16-64 rows).
inline vfloat in_register(vfloat v) {
#if defined(__GNUC__) && defined(__AVX__)
  asm("" : "+x"(v));
#endif
  return v;
}

struct Problem {
  const float* x;  // [m, k]
  const float* x_pairs;  // null, or x's rows two by two (PairedRows), which the AVX-512 tiles read
  const float* bias;  // [n] or null
  float* y;  // [m, n]
  int64_t m, n, k;
};

inline void store_output(const Problem& p, float total, int64_t xrow, int64_t row) {
  if (p.bias != nullptr) total += p.bias[row];
  p.y[xrow * p.n + row] = total;
}

// Output (xrow, row): the sum of an accumulator's 8 lanes, plus the products past them (from value
// `tail` of x's row and w_row on), plus the bias.
inline void store_dot(const Problem& p, vfloat acc, int64_t xrow, int64_t row, const float* w_row, int64_t tail) {
  float total = sum(acc);
  for (int64_t j = tail; j < p.k; ++j) total = std::fma(p.x[xrow * p.k + j], w_row[j], total);
  store_output(p, total, xrow, row);
}

// Lane i of the result: the sum of acc[i]'s 8 lanes in sum()'s order. The eight are transposed so
// that vector j holds lane j of each, then added in turn, so each lane rounds as sum() does, in
// ~4 instructions per output rather than ~15.
inline vfloat lane_sums(const vfloat (&acc)[8]) {
  vfloat pairs[8], quads[8];
  for (int i = 0; i < 8; i += 2) {
    pairs[i] = __builtin_shufflevector(acc[i], acc[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    pairs[i + 1] = __builtin_shufflevector(acc[i], acc[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  // quads[q + j], per 128-bit half: lane j (first half) or 4 + j (second) of acc[q..q+3].
  for (int q = 0; q < 8; q += 4) {
    quads[q] = __builtin_shufflevector(pairs[q], pairs[q + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    quads[q + 1] = __builtin_shufflevector(pairs[q], pairs[q + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    quads[q + 2] = __builtin_shufflevector(pairs[q + 1], pairs[q + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    quads[q + 3] = __builtin_shufflevector(pairs[q + 1], pairs[q + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  vfloat total = {};
  for (int j = 0; j < 4; ++j) total += __builtin_shufflevector(quads[j], quads[4 + j], 0, 1, 2, 3, 8, 9, 10, 11);
  for (int j = 0; j < 4; ++j) total += __builtin_shufflevector(quads[j], quads[4 + j], 4, 5, 6, 7, 12, 13, 14, 15);
  return total;
}

#if EMBER_AVX512
// lane_sums on each 256-bit half of eight 16-float accumulators: lane i of the result is the sum
// of acc[i]'s lower half, lane 8 + i of its upper half. Summed one by one, a pair tile's outputs
// took 35% of its time at 16 rows and k = 576; summed this way, 11%.
__attribute__((always_inline)) inline __m512 lane_sums(const __m512 (&acc)[8]) {
  __m512 pairs[8], quads[8];
  for (int i = 0; i < 8; i += 2) {
    pairs[i] = _mm512_unpacklo_ps(acc[i], acc[i + 1]);
    pairs[i + 1] = _mm512_unpackhi_ps(acc[i], acc[i + 1]);
  }
  // quads[q + j], per 128-bit chunk: lane j (first chunk of a half) or 4 + j (second) of acc[q..q+3].
  for (int q = 0; q < 8; q += 4) {
    quads[q] = _mm512_shuffle_ps(pairs[q], pairs[q + 2], 0x44);
    quads[q + 1] = _mm512_shuffle_ps(pairs[q], pairs[q + 2], 0xEE);
    quads[q + 2] = _mm512_shuffle_ps(pairs[q + 1], pairs[q + 3], 0x44);
    quads[q + 3] = _mm512_shuffle_ps(pairs[q + 1], pairs[q + 3], 0xEE);
  }
  const __m512i first_chunks = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i second_chunks = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 total = _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) total = _mm512_add_ps(total, _mm512_permutex2var_ps(quads[j], first_chunks, quads[4 + j]));
  for (int j = 0; j < 4; ++j) total = _mm512_add_ps(total, _mm512_permutex2var_ps(quads[j], second_chunks, quads[4 + j]));
  return total;
}
#endif

// store_dot for every output of a tile whose accumulators acc[a][r] cover all of k, eight at a
// time: each accumulator holds Halves outputs, to rows first_xrow(a) + half of x and row + r of W.
template <int64_t Halves, typename Vector, int64_t A, int64_t R, typename FirstXRow>
inline void store_sums(const Problem& p, const Vector (&acc)[A][R], int64_t row, FirstXRow&& first_xrow) {
  constexpr int64_t count = A * R;
  // Unrolled, the indices below are constants.
#pragma GCC unroll 8
  for (int64_t first = 0; first < count; first += 8) {
    Vector eight[8];
    for (int64_t i = 0; i < 8; ++i) eight[i] = first + i < count ? acc[(first + i) / R][(first + i) % R] : Vector{};
    const Vector total = lane_sums(eight);
    float sums[8 * Halves];
    static_assert(sizeof(sums) == sizeof(total));
    std::memcpy(sums, &total, sizeof(sums));
#pragma GCC unroll 8
    for (int64_t i = 0; i < 8 && first + i < count; ++i)
      for (int64_t half = 0, xrow = first_xrow((first + i) / R); half < Halves && xrow + half < p.m; ++half)
        store_output(p, sums[8 * half + i], xrow + half, row + (first + i) % R);
  }
}

// Rows [row, row + Rows) of W, stored at w, against rows [xrow, xrow + XRows) of x: Rows * XRows
// register accumulators. `next`, when set, is the next tile's first row: its Rows rows are
// prefetched a cache line per row every other step, so the next tile streams in while this one computes.
template <int64_t XRows, int64_t Rows>
inline void dot_tile(const Problem& p, const float* w, int64_t xrow, int64_t row, const float* next) {
  const int64_t k = p.k;
  const float* x = p.x + xrow * k;
  vfloat acc[XRows][Rows];
  set_zero(acc);
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    if (next != nullptr && i % (2 * kLanes) == 0)
      for (int64_t r = 0; r < Rows; ++r) __builtin_prefetch(next + r * k + i);
    vfloat xv[XRows];
    for (int64_t a = 0; a < XRows; ++a) xv[a] = in_register(load(x + a * k + i));
    for (int64_t r = 0; r < Rows; ++r) {
      const vfloat wv = in_register(load(w + r * k + i));
      for (int64_t a = 0; a < XRows; ++a) acc[a][r] = multiply_add(xv[a], wv, acc[a][r]);
    }
  }
  // Fewer than 4 outputs do not pay for a transpose.
  if (i == k && XRows * Rows >= 4) return store_sums<1>(p, acc, row, [&](int64_t a) { return xrow + a; });
  for (int64_t a = 0; a < XRows; ++a)
    for (int64_t r = 0; r < Rows; ++r) store_dot(p, acc[a][r], xrow + a, row + r, w + r * k, i);
}

template <int64_t Rows>
inline void rows_against_all_of_x(const Problem& p, const float* w, int64_t row, const float* next) {
  // The first pass over the tile prefetches the next one.
  int64_t xrow = 0;
  for (; xrow + 3 <= p.m; xrow += 3) dot_tile<3, Rows>(p, w, xrow, row, std::exchange(next, nullptr));
  for (; xrow + 2 <= p.m; xrow += 2) dot_tile<2, Rows>(p, w, xrow, row, std::exchange(next, nullptr));
  for (; xrow < p.m; ++xrow) dot_tile<1, Rows>(p, w, xrow, row, std::exchange(next, nullptr));
}

#if EMBER_AVX512
// With AVX-512, one 16-float register holds 8 values of two x rows, [row a: i..i+7 | row a+1: i..i+7],
// and the weights' 8 values go to both halves: each half runs exactly dot_tile's FMAs, so every
// output keeps its bits, with half the FMA instructions and more weight rows per x load (SmolLM2's
// Q4_1 layers, 2 threads: 1.15-1.2x at 11-16 rows, 1.0-1.1x at 4 and at 32-56; a whole batch-16
// decode step 1.2x).
constexpr int64_t kPairTileRows = 6;
constexpr int64_t kMaxPairsPerTile = 4;  // 24 accumulators + 4 x pairs + 1 weight vector of the 32 registers

// x's rows two by two, 8 values of each in turn: [pairs, k / 8, 16]; an odd m's last pair ends in zeros.
class PairedRows {
 public:
  PairedRows(const float* x, int64_t m, int64_t k) : full_(k / kLanes * kLanes), values_((m + 1) / 2 * 2 * full_ / 16) {
    float* out = data();
    for (int64_t row = 0; row < m; ++row)
      for (int64_t i = 0; i < full_; i += kLanes) std::memcpy(out + (row / 2) * 2 * full_ + 2 * i + (row % 2) * kLanes, x + row * k + i, sizeof(vfloat));
  }
  float* data() { return reinterpret_cast<float*>(values_.data()); }

 private:
  int64_t full_;
  struct alignas(64) Sixteen {
    float values[16];
  };
  std::vector<Sixteen> values_;  // zero-initialised, 64-byte aligned
};

// Rows [row, row + Rows) of W, stored at w, against x's pairs [pair, pair + Pairs): dot_tile's
// loop on two x rows per register, with the same prefetch of the next tile.
template <int64_t Pairs, int64_t Rows>
inline void pair_tile(const Problem& p, const float* w, int64_t pair, int64_t row, const float* next) {
  const int64_t k = p.k, full = k / kLanes * kLanes;
  const float* x_pairs = p.x_pairs + pair * 2 * full;
  __m512 acc[Pairs][Rows];
  for (int64_t a = 0; a < Pairs; ++a)
    for (int64_t r = 0; r < Rows; ++r) acc[a][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += kLanes) {
    if (next != nullptr && i % (2 * kLanes) == 0)
      for (int64_t r = 0; r < Rows; ++r) __builtin_prefetch(next + r * k + i);
    __m512 xv[Pairs];
    for (int64_t a = 0; a < Pairs; ++a) xv[a] = _mm512_loadu_ps(x_pairs + a * 2 * full + 2 * i);
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512 wv = _mm512_broadcast_f32x8(_mm256_loadu_ps(w + r * k + i));
      for (int64_t a = 0; a < Pairs; ++a) acc[a][r] = _mm512_fmadd_ps(xv[a], wv, acc[a][r]);
    }
  }
  if (full == k) return store_sums<2>(p, acc, row, [&](int64_t a) { return 2 * (pair + a); });
  for (int64_t a = 0; a < Pairs; ++a) {
    const int64_t xrow = 2 * (pair + a);
    for (int64_t r = 0; r < Rows; ++r) {
      store_dot(p, reinterpret_cast<vfloat>(_mm512_castps512_ps256(acc[a][r])), xrow, row + r, w + r * k, full);
      if (xrow + 1 < p.m)
        store_dot(p, reinterpret_cast<vfloat>(_mm512_extractf32x8_ps(acc[a][r], 1)), xrow + 1, row + r, w + r * k, full);
    }
  }
}

template <int64_t Rows>
inline void rows_against_pairs_of_x(const Problem& p, const float* w, int64_t row, const float* next) {
  const int64_t pairs = (p.m + 1) / 2;
  int64_t pair = 0;
  for (; pair + kMaxPairsPerTile <= pairs; pair += kMaxPairsPerTile)
    pair_tile<kMaxPairsPerTile, Rows>(p, w, pair, row, std::exchange(next, nullptr));
  for (; pair + 2 <= pairs; pair += 2) pair_tile<2, Rows>(p, w, pair, row, std::exchange(next, nullptr));
  for (; pair < pairs; ++pair) pair_tile<1, Rows>(p, w, pair, row, std::exchange(next, nullptr));
}
#endif

// One x row leaves registers for twice as many weight rows: more streams in flight per thread.
inline int64_t tile_rows_for(const Problem& p) {
#if EMBER_AVX512
  if (p.x_pairs != nullptr) return kPairTileRows;
#endif
  return p.m == 1 ? 2 * kTileRows : kTileRows;
}

// The tile of tile_rows_for(p) weight rows starting at `row`, stored at w.
inline void tile_against_x(const Problem& p, const float* w, int64_t row, const float* next) {
#if EMBER_AVX512
  if (p.x_pairs != nullptr) return rows_against_pairs_of_x<kPairTileRows>(p, w, row, next);
#endif
  if (p.m == 1)
    dot_tile<1, 2 * kTileRows>(p, w, 0, row, next);
  else
    rows_against_all_of_x<kTileRows>(p, w, row, next);
}

// Runs body(p) with x's rows paired up for the AVX-512 tiles where they pay: from 2 rows (a dense
// decode step at 2-3 rows measured the same either way; a mixture of experts' expert, which gets a
// few of a step's tokens, runs 1.1x faster at 2 rows and 1.2-1.3x at 3 from Q8_0 blocks on a Zen 4).
template <typename Body>
void with_paired_rows(Problem p, Body&& body) {
#if EMBER_AVX512
  if (p.m >= 2) {
    PairedRows pairs(p.x, p.m, p.k);
    p.x_pairs = pairs.data();
    return body(p);
  }
#endif
  body(p);
}

at::Tensor check_inputs_and_allocate(const at::Tensor& x, int64_t n, int64_t k, const std::optional<at::Tensor>& bias,
                                     const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, op, ": x must be [m, ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_cpu() && x.is_contiguous(), op,
              ": x must be a contiguous float32 CPU tensor, got ", x.scalar_type());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_cpu() &&
                    bias->is_contiguous(),
                op, ": bias must be a contiguous float32 CPU tensor of ", n, " values");
  }
  return at::empty({x.size(0), n}, x.options());
}

const float* bias_or_null(const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
}

// Float32 values of one row of k weights from its blocks.
template <int64_t Format>
inline void expand_row(const uint8_t* blocks, int64_t k, float* out) {
  constexpr BlockLayout layout = kBlockLayouts[Format];
#if EMBER_AVX512
  if constexpr (kExpandsSixteenWide<Format>) {
    for (int64_t i = 0; i < k; i += layout.values, blocks += layout.bytes) expand_block_sixteen_wide<Format>(blocks, out + i);
    return;
  }
#endif
  for (int64_t i = 0; i < k; blocks += layout.bytes) {
    for (int64_t sub = 0; sub < layout.values / kSubBlockValues; ++sub, i += kSubBlockValues) {
      vfloat values[kSubBlockVectors];
      expand_sub_block<Format>(blocks, sub, values);
      for (int64_t j = 0; j < kSubBlockVectors; ++j) store(out + i + j * kLanes, values[j]);
    }
  }
}

// One x row against Rows rows of blocks starting at `row`, each block expanded in registers: no
// round trip through L1. The sums are dot_tile<1, Rows>'s over the expanded rows, in the same order
// and with the same FMAs.
template <int64_t Format, int64_t Rows>
inline void block_rows_against_one_x_row(const Problem& p, const uint8_t* blocks, int64_t row_bytes, int64_t row) {
  constexpr BlockLayout layout = kBlockLayouts[Format];
  vfloat acc[Rows] = {};
  for (int64_t i = 0, offset = 0; i < p.k; offset += layout.bytes) {
    for (int64_t sub = 0; sub < layout.values / kSubBlockValues; ++sub, i += kSubBlockValues) {
      vfloat xv[kSubBlockVectors];
      for (int64_t j = 0; j < kSubBlockVectors; ++j) xv[j] = load(p.x + i + j * kLanes);
      for (int64_t r = 0; r < Rows; ++r) {
        vfloat w[kSubBlockVectors];
        expand_sub_block<Format>(blocks + (row + r) * row_bytes + offset, sub, w);
        for (int64_t j = 0; j < kSubBlockVectors; ++j) acc[r] = multiply_add(xv[j], w[j], acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r) {
    float total = sum(acc[r]);
    if (p.bias != nullptr) total += p.bias[row + r];
    p.y[row + r] = total;
  }
}

void check_blocks(const at::Tensor& blocks, int64_t format, int64_t k, const char* op) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_cpu() && blocks.is_contiguous(), op,
              ": blocks must be a contiguous uint8 CPU tensor [out_features, bytes per row]");
  const BlockLayout layout = block_layout(format);
  TORCH_CHECK(k > 0 && k % layout.values == 0, op, ": in_features must be a positive multiple of ", layout.values,
              " in this format, got ", k);
  TORCH_CHECK(blocks.size(1) == k / layout.values * layout.bytes, op, ": rows of ", k, " weights take ",
              k / layout.values * layout.bytes, " bytes in this format, blocks has ", blocks.size(1));
}

// Hardware prefetchers restart at every 4 KiB page, so a one-row step, which streams the blocks
// with little compute per byte, would wait on memory between bursts of compute; fetching a few rows
// ahead overlaps the two (measured: ~1.4x faster).
constexpr int64_t kPrefetchRowsAhead = 4;

template <int64_t Format>
void gguf_block_linear_as(const Problem& p, const uint8_t* blocks, int64_t row_bytes) {
  const int64_t tile_rows = tile_rows_for(p), full_tiles = p.n / tile_rows, k = p.k;
  // Vectors, so the tile is 32-byte aligned and its loads never straddle two cache lines (5-9%
  // faster in a microbenchmark of expand + tiles; within noise in a whole step).
  const auto tile_buffer = [&] { return std::vector<vfloat>(p.m == 1 ? 0 : tile_rows * k / kLanes); };
  parallel_over_tiles(full_tiles, tile_buffer, [&](std::vector<vfloat>& tile_vectors, int64_t begin, int64_t end) {
    float* tile_weights = reinterpret_cast<float*>(tile_vectors.data());
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t row = tile * tile_rows;
      if (p.m == 1) {
        // Two rows at a time: their accumulators, x and the expanded values fit in registers
        // (measured: 2 rows ~1.3x faster than 4 or 8, which spill).
        for (int64_t r = 0; r < tile_rows; r += 2) {
          prefetch_block_rows(blocks, row_bytes, p.n, row + r + kPrefetchRowsAhead, 2);
          block_rows_against_one_x_row<Format, 2>(p, blocks, row_bytes, row + r);
        }
        continue;
      }
      // Into L2: with more x rows the tiles are bound by their FMAs, and the next tile's blocks
      // in L1 would evict this one's values (measured slower).
      prefetch_block_rows<2>(blocks, row_bytes, p.n, row + tile_rows, tile_rows);
      for (int64_t r = 0; r < tile_rows; ++r)
        expand_row<Format>(blocks + (row + r) * row_bytes, k, tile_weights + r * k);
      tile_against_x(p, tile_weights, row, nullptr);
    }
  });
  std::vector<vfloat> row_vectors(k / kLanes);
  float* row_weights = reinterpret_cast<float*>(row_vectors.data());
  for (int64_t row = full_tiles * tile_rows; row < p.n; ++row) {
    expand_row<Format>(blocks + row * row_bytes, k, row_weights);
    rows_against_all_of_x<1>(p, row_weights, row, nullptr);
  }
}

}  // namespace

namespace ember {

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_cpu() && weight.is_contiguous(),
              "small_batch_linear: weight must be a contiguous float32 CPU tensor [n, k], got ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor y = check_inputs_and_allocate(x, n, k, bias, "small_batch_linear");
  const int64_t m = x.size(0);
  if (m == 0 || n == 0) return y;
  const float* w = weight.data_ptr<float>();
  with_paired_rows({x.data_ptr<float>(), nullptr, bias_or_null(bias), y.data_ptr<float>(), m, n, k}, [&](const Problem& p) {
    const int64_t tile_rows = tile_rows_for(p), full_tiles = n / tile_rows;
    parallel_over_tiles(full_tiles, [] { return 0; }, [&](int /* no state */, int64_t begin, int64_t end) {
      for (int64_t tile = begin; tile < end; ++tile) {
        const float* next = tile + 1 < full_tiles ? w + (tile + 1) * tile_rows * k : nullptr;
        tile_against_x(p, w + tile * tile_rows * k, tile * tile_rows, next);
      }
    });
    for (int64_t row = full_tiles * tile_rows; row < n; ++row) rows_against_all_of_x<1>(p, w + row * k, row, nullptr);
  });
  return y;
}

at::Tensor gguf_block_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                             int64_t format, int64_t in_features) {
  const int64_t n = blocks.size(0), k = in_features;
  check_blocks(blocks, format, k, "gguf_block_linear");
  at::Tensor y = check_inputs_and_allocate(x, n, k, bias, "gguf_block_linear");
  const int64_t m = x.size(0);
  if (m == 0 || n == 0) return y;
  with_paired_rows({x.data_ptr<float>(), nullptr, bias_or_null(bias), y.data_ptr<float>(), m, n, k}, [&](const Problem& p) {
    with_block_format(format, [&](auto f) { gguf_block_linear_as<f()>(p, blocks.data_ptr<uint8_t>(), blocks.size(1)); });
  });
  return y;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t format, int64_t in_features) {
  check_blocks(blocks, format, in_features, "gguf_dequantize");
  const int64_t n = blocks.size(0), k = in_features, row_bytes = blocks.size(1);
  at::Tensor out = at::empty({n, k}, blocks.options().dtype(at::kFloat));
  const uint8_t* raw = blocks.data_ptr<uint8_t>();
  float* values = out.data_ptr<float>();
  with_block_format(format, [&](auto f) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) expand_row<f()>(raw + row * row_bytes, k, values + row * k);
    });
  });
  return out;
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gguf_block_linear(Tensor x, Tensor blocks, Tensor? bias, int format, int in_features) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int format, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("small_batch_linear", &ember::small_batch_linear);
  m.impl("gguf_block_linear", &ember::gguf_block_linear);
  m.impl("gguf_dequantize", &ember::gguf_dequantize);
}
