// LoRA deltas of a batch whose rows run different adapters (S-LoRA / Punica's batching), in one call:
// for each row r whose slot s >= 0, y[r] += scale[s] * B[s] (A[s] x[r]), summed in float32 whatever
// the dtypes of y and x and of A and B (each float32 or bfloat16), each sum in one fixed order (8
// lanes, then the lanes in order), so a row's delta has the same bits whatever else the batch holds
// and on every instruction set.
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kTile = 64;  // outputs a task of the B product holds in its lanes

template <typename T>
inline float as_float(T value) {  // float itself, or a bfloat16 widened
  return static_cast<float>(value);
}

// out[q] = sum_j a[j] * xs[q][j] for up to kRows rows at once (a is read once for them): per row
// kLanes independent partial sums (which the compiler vectorises without reordering any of them),
// then added in lane order; a row's sum is the same whichever rows share the call.
constexpr int64_t kRows = 4;

template <typename A, typename X>
void dots(const A* a, const X* const* xs, int64_t rows, int64_t n, float* out) {
  // Always kRows rows, so that the accumulators stay in registers: past `rows` they repeat row 0.
  const X* x[kRows];
  for (int64_t q = 0; q < kRows; ++q) x[q] = xs[q < rows ? q : 0];
  float lanes[kRows][kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t q = 0; q < kRows; ++q) {
      for (int64_t l = 0; l < kLanes; ++l) lanes[q][l] += as_float(a[j + l]) * as_float(x[q][j + l]);
    }
  }
  for (; j < n; ++j) {
    for (int64_t q = 0; q < kRows; ++q) lanes[q][j % kLanes] += as_float(a[j]) * as_float(x[q][j]);
  }
  for (int64_t q = 0; q < rows; ++q) {
    float sum = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) sum += lanes[q][l];
    out[q] = sum;
  }
}

// A fused linear's parts (QKV, gate/up) each have their band of the rank, of `band` values, and an
// adapter fills the first ranks[slot][part] of a band (0: it leaves the part alone): only those are
// read. Each weight row is read once per adapter present, for all of that adapter's rows; the work
// splits by (adapter, weight row), so no output's sum depends on how it is split.
template <typename T, typename W>
void add_rows(T* y, const T* x, const W* lora_a, const W* lora_b, const int64_t* slots, const std::vector<float>& scales,
              at::IntArrayRef part_rows, const int64_t* ranks, int64_t num_parts, int64_t band,
              int64_t m, int64_t in, int64_t out) {
  const int64_t rank = num_parts * band;
  std::vector<int64_t> present;
  std::vector<std::vector<int64_t>> rows_of(scales.size());
  for (int64_t row = 0; row < m; ++row) {
    if (slots[row] < 0) continue;
    if (rows_of[slots[row]].empty()) present.push_back(slots[row]);
    rows_of[slots[row]].push_back(row);
  }
  const int64_t groups = static_cast<int64_t>(present.size());
  std::vector<float> h(m * rank);  // the rows' A x, by band
  at::parallel_for(0, groups * rank, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t slot = present[task / rank], r = task % rank;
      if (r % band >= ranks[slot * num_parts + r / band]) continue;
      const W* a = lora_a + (slot * rank + r) * in;
      const std::vector<int64_t>& rows = rows_of[slot];
      for (size_t first = 0; first < rows.size(); first += kRows) {
        const int64_t count = std::min<int64_t>(kRows, static_cast<int64_t>(rows.size() - first));
        const T* xs[kRows];
        float sums[kRows];
        for (int64_t q = 0; q < count; ++q) xs[q] = x + rows[first + q] * in;
        dots(a, xs, count, in, sums);
        for (int64_t q = 0; q < count; ++q) h[rows[first + q] * rank + r] = sums[q];
      }
    }
  });
  // B is stored transposed ([rank, out] per slot): an output tile's sums run over the band's values
  // in order, each output in its own lane.
  struct Tile {
    int64_t slot, part, first, size;
  };
  std::vector<Tile> tiles;
  int64_t part_start = 0;
  for (int64_t part = 0; part < num_parts; ++part) {
    const int64_t part_end = part_start + part_rows[part];
    for (const int64_t slot : present) {
      if (ranks[slot * num_parts + part] == 0) continue;
      for (int64_t first = part_start; first < part_end; first += kTile) tiles.push_back({slot, part, first, std::min(kTile, part_end - first)});
    }
    part_start = part_end;
  }
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    float sums[kTile];
    for (int64_t t = begin; t < end; ++t) {
      const Tile& tile = tiles[t];
      const int64_t used = ranks[tile.slot * num_parts + tile.part], offset = tile.part * band;
      for (const int64_t row : rows_of[tile.slot]) {
        for (int64_t k = 0; k < tile.size; ++k) sums[k] = 0.0f;
        for (int64_t r = 0; r < used; ++r) {
          const float value = h[row * rank + offset + r];
          const W* bt = lora_b + (tile.slot * rank + offset + r) * out + tile.first;
          for (int64_t k = 0; k < tile.size; ++k) sums[k] += value * as_float(bt[k]);
        }
        T* target = y + row * out + tile.first;
        for (int64_t k = 0; k < tile.size; ++k) target[k] = static_cast<T>(as_float(target[k]) + sums[k] * scales[tile.slot]);
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
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.scalar_type() == lora_b.scalar_type() &&
                  (lora_a.scalar_type() == at::kFloat || lora_a.scalar_type() == at::kBFloat16) &&
                  lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_add_: lora_a [slots, rank, in] and lora_b [slots, rank, out] must be contiguous, both float32 or bfloat16");
  const int64_t m = x.size(0), in = x.size(1), out = y.size(1), num_slots = lora_a.size(0), rank = lora_a.size(1);
  TORCH_CHECK(lora_a.size(2) == in && lora_b.size(0) == num_slots && lora_b.size(1) == rank && lora_b.size(2) == out,
              "lora_add_: the stacks' shapes do not match x and y (lora_b is [slots, rank, out], B transposed)");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.dim() == 1 && row_slots.size(0) == m && row_slots.is_contiguous(),
              "lora_add_: row_slots must be int64 [m]");
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == num_slots, "lora_add_: one scale per slot");
  const int64_t num_parts = static_cast<int64_t>(part_rows.size());
  TORCH_CHECK(num_parts > 0 && rank % num_parts == 0, "lora_add_: the rank splits into one band per part");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.dim() == 2 && ranks.size(0) == num_slots &&
                  ranks.size(1) == num_parts,
              "lora_add_: ranks must be int64 [slots, parts]");
  const int64_t band = rank / num_parts;
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
