// The experts of a mixture-of-experts MLP for a batch of tokens (float32 or bfloat16, CPU): each
// expert that some token selected runs once, for its tokens only, from its dense rows or its GGUF
// blocks, so a step reads the weights of the experts it uses and no others. A token's output is
// the sum of weight * expert(x) over its experts in ascending expert order, onto zero: the order
// transformers adds them in. ember::linear's rows never depend on each other, so neither does a
// token's output on which tokens shared its experts.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"
#include "parallel_tiles.h"

namespace {

// From this many selected experts a thread, each runs whole on one thread; with fewer, each
// expert's linears are split across the threads. The int8 linears (fast numerics) stream an expert
// quickly enough that the hand-off between threads is their cost from one expert a thread: a
// one-token decode's 4 experts on 2 threads run 2 a thread (Qwen3-MoE-shaped Q8_0, Zen 4: 5.9-6.0
// against 6.4-7.4 ms a token split). The exact linears widen every block, and splitting them
// stays ahead up to 4 a thread (10.6-10.8 against 11.0-11.1 ms a token).
constexpr int64_t kExpertsPerThreadToSplit = 4;
constexpr int64_t kInt8ExpertsPerThreadToSplit = 1;

void check_inputs(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                  const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x must be a contiguous float32 or bfloat16 CPU tensor [tokens, hidden], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0) && expert_ids.scalar_type() == at::kLong &&
                  expert_ids.is_contiguous(),
              "moe_experts: expert_ids must be a contiguous int64 tensor [tokens, top_k], got ", expert_ids.sizes());
  TORCH_CHECK(expert_weights.sizes() == expert_ids.sizes() && expert_weights.scalar_type() == x.scalar_type(),
              "moe_experts: expert_weights must match expert_ids' shape in x's dtype, got ", expert_weights.scalar_type(),
              " ", expert_weights.sizes());
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0) && gate_up.is_contiguous() &&
                  down.is_contiguous(),
              "moe_experts: gate_up and down must be contiguous [experts, rows, columns] stacks of the same experts, "
              "got ", gate_up.sizes(), " and ", down.sizes());
}

}  // namespace

namespace ember {

// gate_up [experts, 2 * expert_size, ...] holds each expert's gate rows then its up rows; down
// [experts, hidden, ...]; each in `format` (kPlainWeight: x's dtype, else GGUF blocks as uint8; ember::linear's codes).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                       const at::Tensor& gate_up, int64_t gate_up_format, const at::Tensor& down, int64_t down_format,
                       bool gelu) {
  check_inputs(x, expert_ids, expert_weights, gate_up, down);
  const int64_t tokens = x.size(0), top_k = expert_ids.size(1), experts = gate_up.size(0);
  at::Tensor out = at::zeros_like(x);
  // A counting sort of the (token, slot) pairs by expert, tokens ascending within each expert.
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  std::vector<int64_t> starts(experts + 1, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < experts, "moe_experts: expert id ", ids[i], " is not one of the ", experts,
                " experts");
    ++starts[ids[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  const at::Tensor rows = at::empty({tokens * top_k}, expert_ids.options());  // the tokens, by expert
  const at::Tensor slots = at::empty({tokens * top_k}, expert_ids.options());  // token * top_k + slot
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  int64_t* row_data = rows.data_ptr<int64_t>();
  int64_t* slot_data = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t at = next[ids[i]]++;
    row_data[at] = i / top_k;
    slot_data[at] = i;
  }
  const at::Tensor weights = expert_weights.reshape({-1});
  std::vector<int64_t> used;
  for (int64_t e = 0; e < experts; ++e)
    if (starts[e + 1] > starts[e]) used.push_back(e);
  std::vector<at::Tensor> outputs(used.size());
  const auto run_expert = [&](int64_t index) {
    const int64_t e = used[index], count = starts[e + 1] - starts[e];
    const at::Tensor gate_up_out =
        linear(x.index_select(0, rows.narrow(0, starts[e], count)), gate_up[e], std::nullopt, gate_up_format);
    const at::Tensor activated = gelu ? gelu_tanh_and_mul(gate_up_out) : silu_and_mul(gate_up_out);
    outputs[index] = linear(activated, down[e], std::nullopt, down_format);
    outputs[index].mul_(weights.index_select(0, slots.narrow(0, starts[e], count)).unsqueeze(1));
  };
  const int64_t used_count = static_cast<int64_t>(used.size());
  const int64_t per_thread = gate_up_format >= kInt8Arithmetic ? kInt8ExpertsPerThreadToSplit : kExpertsPerThreadToSplit;
  if (used_count >= per_thread * at::get_num_threads()) {
    // Whole experts per thread, the next one to whichever is free: their linears run serially
    // inside (ATen runs a parallel_for nested in another inline). A step of many experts with a
    // few tokens each then pays no hand-off between threads for each of its ~2 linears an expert.
    parallel_over_tiles(used_count, [] { return 0; }, [&](int, int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) run_expert(index);
    }, /* per_take = */ 1);
  } else {
    for (int64_t index = 0; index < used_count; ++index) run_expert(index);  // each linear split across threads
  }
  for (int64_t index = 0; index < used_count; ++index) {  // ascending experts: every token's sum in one order
    const int64_t e = used[index];
    out.index_add_(0, rows.narrow(0, starts[e], starts[e + 1] - starts[e]), outputs[index]);
  }
  return out;
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def(
      "moe_experts(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor gate_up, int gate_up_format, "
      "Tensor down, int down_format, bool gelu) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("moe_experts", &ember::moe_experts); }
