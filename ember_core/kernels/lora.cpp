// LoRA deltas of a batch whose rows run different adapters (S-LoRA / Punica's batching), in one call:
// for each row r whose slot s >= 0, y[r] += scale[s] * B[s] (A[s] x[r]), summed in float32 whatever
// the dtypes of y and x and of A and B (each float32 or bfloat16). The stacks are laid out for
// sums side by side: A transposed per part ([slots, parts, in, band]) and B transposed ([slots, band,
// out]), so each rank (then each output) is a lane of its own, summed over its terms in one fixed
// order: a row's delta has the same bits whatever else the batch holds, at any vector width, on
// every instruction set.
#include "ops.h"
#include "vec8.h"  // vfloat, set_zero

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kRows = 4;        // rows of one adapter a task sums at once, reading its weights once for them
constexpr int64_t kRankLanes = 16;  // ranks summed side by side
constexpr int64_t kOutLanes = 32;   // outputs summed side by side
constexpr int64_t kTile = 64;       // outputs of a task of the second product

template <typename T>
inline float as_float(T value) {  // float itself, or a bfloat16 widened
  return static_cast<float>(value);
}

// N floats as one vector (GCC/Clang vector extensions): 16 fill an AVX-512 register and split in
// two on AVX2. Each lane is a sum of its own, so the width changes no bits.
using float16_vector = float __attribute__((vector_size(16 * sizeof(float))));
using half16_vector = uint16_t __attribute__((vector_size(16 * sizeof(uint16_t))));
using word16_vector = uint32_t __attribute__((vector_size(16 * sizeof(uint32_t))));

template <int64_t N>
struct Vectors;
template <>
struct Vectors<8> {
  using floats = vfloat;
  using halves = vbf16;
  using words = vuint;
};
template <>
struct Vectors<16> {
  using floats = float16_vector;
  using halves = half16_vector;
  using words = word16_vector;
};
template <int64_t N>
using floats = typename Vectors<N>::floats;

template <int64_t N>
inline floats<N> load_weights(const float* p) {
  floats<N> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int64_t N>
inline floats<N> load_weights(const c10::BFloat16* p) {  // widened exactly
  typename Vectors<N>::halves bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<floats<N>>(__builtin_convertvector(bits, typename Vectors<N>::words) << 16);
}

template <int64_t N>
inline floats<N> splat(float x) {
  return floats<N>{} + x;
}

// The vector width of a Width-lane sum: 16 where it divides it, else 8.
template <int64_t Width>
constexpr int64_t kVectorLanes = Width % 16 == 0 ? 16 : 8;

// h[q][l] = sum_j x[q][j] * at[j * stride + l] for kRows rows (past `count` they repeat row 0) and
// Width lanes (a multiple of 8, or 1): the even j and the odd j each summed in order, then added.
// Each lane is a sum of its own, the same whether it runs in a vector or alone.
template <int64_t Width, typename X, typename W>
void shrink(const X* const* rows, int64_t count, const W* at, int64_t stride, int64_t in, float* h) {
  const X* x[kRows];
  for (int64_t q = 0; q < kRows; ++q) x[q] = rows[q < count ? q : 0];
  if constexpr (Width == 1) {
    for (int64_t q = 0; q < count; ++q) {
      float even = 0.0f, odd = 0.0f;
      int64_t j = 0;
      for (; j + 1 < in; j += 2) {
        even += as_float(x[q][j]) * as_float(at[j * stride]);
        odd += as_float(x[q][j + 1]) * as_float(at[(j + 1) * stride]);
      }
      if (j < in) even += as_float(x[q][j]) * as_float(at[j * stride]);
      h[q] = even + odd;
    }
  } else {
    constexpr int64_t N = kVectorLanes<Width>, kVectors = Width / N;
    floats<N> even[kRows][kVectors], odd[kRows][kVectors];
    set_zero(even);
    set_zero(odd);
    int64_t j = 0;
    for (; j + 1 < in; j += 2) {
      floats<N> a0[kVectors], a1[kVectors];
      for (int64_t v = 0; v < kVectors; ++v) {
        a0[v] = load_weights<N>(at + j * stride + v * N);
        a1[v] = load_weights<N>(at + (j + 1) * stride + v * N);
      }
      for (int64_t q = 0; q < kRows; ++q) {
        const floats<N> x0 = splat<N>(as_float(x[q][j])), x1 = splat<N>(as_float(x[q][j + 1]));
        for (int64_t v = 0; v < kVectors; ++v) {
          even[q][v] += x0 * a0[v];
          odd[q][v] += x1 * a1[v];
        }
      }
    }
    if (j < in) {
      for (int64_t q = 0; q < kRows; ++q) {
        const floats<N> x0 = splat<N>(as_float(x[q][j]));
        for (int64_t v = 0; v < kVectors; ++v) even[q][v] += x0 * load_weights<N>(at + j * stride + v * N);
      }
    }
    for (int64_t q = 0; q < count; ++q) {
      for (int64_t v = 0; v < kVectors; ++v) {
        const floats<N> sum = even[q][v] + odd[q][v];
        std::memcpy(h + q * Width + v * N, &sum, sizeof(sum));
      }
    }
  }
}

// y[q][k] += scale * sum_r h[q][r] * bt[r * out + k] for kRows rows and Width outputs (a multiple
// of 8, or 1), r in order.
template <int64_t Width, typename T, typename W>
void expand(const float* const* hs, T* const* ys, int64_t count, const W* bt, int64_t used, int64_t out, float scale) {
  const float* h[kRows];
  for (int64_t q = 0; q < kRows; ++q) h[q] = hs[q < count ? q : 0];
  float sums[kRows][Width];
  if constexpr (Width == 1) {
    for (int64_t q = 0; q < kRows; ++q) {
      sums[q][0] = 0.0f;
      for (int64_t r = 0; r < used; ++r) sums[q][0] += h[q][r] * as_float(bt[r * out]);
    }
  } else {
    constexpr int64_t N = kVectorLanes<Width>, kVectors = Width / N;
    floats<N> acc[kRows][kVectors];
    set_zero(acc);
    for (int64_t r = 0; r < used; ++r) {
      const W* b = bt + r * out;
      __builtin_prefetch(b + 2 * Width);  // the next tile's columns of this rank, from a row far from the last
      floats<N> weights[kVectors];
      for (int64_t v = 0; v < kVectors; ++v) weights[v] = load_weights<N>(b + v * N);
      for (int64_t q = 0; q < kRows; ++q) {
        const floats<N> value = splat<N>(h[q][r]);
        for (int64_t v = 0; v < kVectors; ++v) acc[q][v] += value * weights[v];
      }
    }
    for (int64_t q = 0; q < kRows; ++q) std::memcpy(sums[q], acc[q], sizeof(acc[q]));
  }
  for (int64_t q = 0; q < count; ++q) {
    for (int64_t k = 0; k < Width; ++k) ys[q][k] = static_cast<T>(as_float(ys[q][k]) + sums[q][k] * scale);
  }
}

// [0, n) as (offset, width) chunks of Lanes, then of 8, then of 1: the widths the sums are built for.
template <int64_t Lanes>
std::vector<std::pair<int64_t, int64_t>> chunks(int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t offset = 0;
  for (; offset + Lanes <= n; offset += Lanes) out.emplace_back(offset, Lanes);
  for (; offset + 8 <= n; offset += 8) out.emplace_back(offset, 8);
  for (; offset < n; ++offset) out.emplace_back(offset, 1);
  return out;
}

template <typename X, typename W>
void shrink_chunk(int64_t width, const X* const* rows, int64_t count, const W* at, int64_t stride, int64_t in, float* h) {
  if (width == kRankLanes) return shrink<kRankLanes>(rows, count, at, stride, in, h);
  if (width == 8) return shrink<8>(rows, count, at, stride, in, h);
  shrink<1>(rows, count, at, stride, in, h);
}

template <typename T, typename W>
void expand_chunk(int64_t width, const float* const* hs, T* const* ys, int64_t count, const W* bt, int64_t used, int64_t out,
                  float scale) {
  if (width == kOutLanes) return expand<kOutLanes>(hs, ys, count, bt, used, out, scale);
  if (width == 8) return expand<8>(hs, ys, count, bt, used, out, scale);
  expand<1>(hs, ys, count, bt, used, out, scale);
}

// A fused linear's parts (QKV, gate/up) each have their band of A, of `band` ranks, and an adapter
// fills the first ranks[slot][part] of a band (0: it leaves the part alone): only those are read.
// The work splits by (adapter, part, rows) and then by (adapter, output tile), never inside a sum.
template <typename T, typename W>
void add_rows(T* y, const T* x, const W* lora_a, const W* lora_b, const int64_t* slots, const std::vector<float>& scales,
              at::IntArrayRef part_rows, const int64_t* ranks, int64_t num_parts, int64_t band, int64_t m, int64_t in,
              int64_t out) {
  std::vector<int64_t> present;
  std::vector<std::vector<int64_t>> rows_of(scales.size());
  for (int64_t row = 0; row < m; ++row) {
    if (slots[row] < 0) continue;
    if (rows_of[slots[row]].empty()) present.push_back(slots[row]);
    rows_of[slots[row]].push_back(row);
  }
  struct Block {
    int64_t slot, part, first, count;  // rows_of[slot][first, first + count), or a tile's outputs
  };
  std::vector<Block> shrinks, tiles;
  std::vector<int64_t> part_start{0};
  for (int64_t part = 0; part < num_parts; ++part) part_start.push_back(part_start.back() + part_rows[part]);
  for (const int64_t slot : present) {
    const int64_t rows = static_cast<int64_t>(rows_of[slot].size());
    for (int64_t part = 0; part < num_parts; ++part) {
      if (ranks[slot * num_parts + part] == 0) continue;
      for (int64_t first = 0; first < rows; first += kRows) shrinks.push_back({slot, part, first, std::min(kRows, rows - first)});
      for (int64_t first = part_start[part]; first < part_start[part + 1]; first += kTile)
        tiles.push_back({slot, part, first, std::min(kTile, part_start[part + 1] - first)});
    }
  }
  const int64_t h_row = num_parts * band;
  std::vector<float> h(m * h_row);  // each row's A x, by part
  at::parallel_for(0, static_cast<int64_t>(shrinks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Block& block = shrinks[task];
      const T* xs[kRows];
      for (int64_t q = 0; q < block.count; ++q) xs[q] = x + rows_of[block.slot][block.first + q] * in;
      const W* at = lora_a + (block.slot * num_parts + block.part) * in * band;
      float scratch[kRows * kRankLanes];  // the rows' sums side by side, then copied to their rows of h
      for (const auto& [lane, width] : chunks<kRankLanes>(ranks[block.slot * num_parts + block.part])) {
        shrink_chunk(width, xs, block.count, at + lane, band, in, scratch);
        for (int64_t q = 0; q < block.count; ++q) {
          float* target = h.data() + rows_of[block.slot][block.first + q] * h_row + block.part * band + lane;
          std::copy(scratch + q * width, scratch + (q + 1) * width, target);
        }
      }
    }
  });
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Block& tile = tiles[task];
      const std::vector<int64_t>& rows = rows_of[tile.slot];
      const int64_t used = ranks[tile.slot * num_parts + tile.part];
      for (size_t first = 0; first < rows.size(); first += kRows) {
        const int64_t count = std::min<int64_t>(kRows, static_cast<int64_t>(rows.size() - first));
        const float* hs[kRows];
        T* ys[kRows];
        for (int64_t q = 0; q < count; ++q) hs[q] = h.data() + rows[first + q] * h_row + tile.part * band;
        for (const auto& [offset, width] : chunks<kOutLanes>(tile.count)) {
          for (int64_t q = 0; q < count; ++q) ys[q] = y + rows[first + q] * out + tile.first + offset;
          expand_chunk(width, hs, ys, count, lora_b + tile.slot * band * out + tile.first + offset, used, out,
                       scales[tile.slot]);
        }
      }
    }
  });
}

}  // namespace

namespace ember {

void lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& row_slots, at::ArrayRef<double> scales, at::IntArrayRef part_rows, const at::Tensor& ranks) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.is_contiguous() && y.is_contiguous(),
              "lora_add_: x [m, in] and y [m, out] must be contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add_: x and y must both be float32 or bfloat16");
  TORCH_CHECK(lora_a.dim() == 4 && lora_b.dim() == 3 && lora_a.scalar_type() == lora_b.scalar_type() &&
                  (lora_a.scalar_type() == at::kFloat || lora_a.scalar_type() == at::kBFloat16) &&
                  lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_add_: lora_a [slots, parts, in, band] and lora_b [slots, band, out] must be contiguous, both float32 ",
              "or bfloat16");
  const int64_t m = x.size(0), in = x.size(1), out = y.size(1), num_slots = lora_a.size(0);
  const int64_t num_parts = lora_a.size(1), band = lora_a.size(3);
  TORCH_CHECK(lora_a.size(2) == in && lora_b.size(0) == num_slots && lora_b.size(1) == band && lora_b.size(2) == out,
              "lora_add_: the stacks' shapes do not match x and y (lora_a is A transposed per part, lora_b B transposed)");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.dim() == 1 && row_slots.size(0) == m && row_slots.is_contiguous(),
              "lora_add_: row_slots must be int64 [m]");
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == num_slots, "lora_add_: one scale per slot");
  TORCH_CHECK(static_cast<int64_t>(part_rows.size()) == num_parts, "lora_add_: one row count per part");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.dim() == 2 && ranks.size(0) == num_slots &&
                  ranks.size(1) == num_parts,
              "lora_add_: ranks must be int64 [slots, parts]");
  const int64_t* used = ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_slots * num_parts; ++i) TORCH_CHECK(used[i] >= 0 && used[i] <= band, "lora_add_: a rank exceeds its band");
  int64_t parts_total = 0;
  for (const int64_t rows : part_rows) parts_total += rows;
  TORCH_CHECK(parts_total == out, "lora_add_: the parts' rows must add up to y's columns");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t row = 0; row < m; ++row) TORCH_CHECK(slots[row] < num_slots, "lora_add_: a row's slot is out of range");
  const std::vector<float> scale_values(scales.begin(), scales.end());
  const auto run = [&](auto* y_values, const auto* x_values) {
    if (lora_a.scalar_type() == at::kFloat) {
      add_rows(y_values, x_values, lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), slots, scale_values, part_rows, used,
               num_parts, band, m, in, out);
    } else {
      add_rows(y_values, x_values, lora_a.data_ptr<at::BFloat16>(), lora_b.data_ptr<at::BFloat16>(), slots, scale_values,
               part_rows, used, num_parts, band, m, in, out);
    }
  };
  if (x.scalar_type() == at::kFloat) {
    run(y.data_ptr<float>(), x.data_ptr<float>());
  } else {
    run(y.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>());
  }
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots, float[] scales, int[] part_rows, "
        "Tensor ranks) -> ()");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("lora_add_", &ember::lora_add_);
}
