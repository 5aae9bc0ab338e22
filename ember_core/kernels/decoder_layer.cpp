// A whole decoder layer of a decode step as one call (float32 or bfloat16, CPU), composed of ember's
// other ops in the order models/decoder.py calls them, so its outputs are bit-identical to the
// layer's modules. At batch 1 the layer's ~20 eager ops and module calls cost ~4 ms of a ~20 ms
// step in Python and dispatch; from here each op is a plain C++ call. The families' switches
// arrive as data: which norms are present, q/k norms per head or over the whole projection, the
// activation, partial rotary (cos/sin narrower than a head), a soft-cap and a sliding window.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "gguf_blocks.h"
#include "kv_quant.h"
#include "ops.h"

namespace {

constexpr int64_t kLinears = 4;  // qkv, o, gate_up, down
constexpr int64_t kAttentionLinears = 2;  // qkv, o: the attention half alone, for a layer whose MLP runs elsewhere
// The norms' slots: before and after attention, before and after the MLP, then the q and k norms.
enum Norm : int64_t { kAttentionIn, kAttentionOut, kMlpIn, kMlpOut, kQuery, kKey, kNorms };
// What a call runs: the whole layer, or a tensor-parallel rank's attention or MLP up to its linear's
// output, its part of the sum the ranks add up before the norm after it and the residual.
enum Stage : int64_t { kWholeLayer, kAttentionPart, kMlpPart };

at::Tensor normed(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  return weight ? ember::rms_norm(x, *weight, eps) : x;
}

// A q or k norm in place over `columns` [tokens, heads * head_dim] of the QKV output: per head when
// the weight is head_dim long, else over all the heads' columns at once (OLMo 2).
void norm_heads_(const at::Tensor& columns, int64_t heads, int64_t head_dim, const at::Tensor& weight, double eps) {
  const int64_t groups = weight.size(0) == head_dim ? heads : 1;
  ember::rms_norm_(columns.view({columns.size(0), groups, heads * head_dim / groups}), weight, eps);
}

// The layer's linears as decoder_layer_ takes them: slot s (qkv, o, gate_up, down) has parts[s]
// weights (and formats) in a row of the flat lists, and its bias. A slot of several parts is a fused
// linear whose parts are stored in different formats (a Q4_K_M file's Q4_K q/k and Q6_K v): each
// part runs alone and their outputs sit side by side before the bias, as layers/linear.py's
// StackedBlockLinear computes it.
struct LayerLinears {
  at::TensorList weights;
  const c10::List<std::optional<at::Tensor>>& biases;
  at::IntArrayRef formats, parts;

  at::Tensor operator()(int64_t slot, const at::Tensor& x) const {
    int64_t first = 0;
    for (int64_t s = 0; s < slot; ++s) first += parts[s];
    if (parts[slot] == 1) return ember::linear(x, weights[first], biases.get(slot), formats[first]);
    std::vector<at::Tensor> outputs;
    for (int64_t part = first; part < first + parts[slot]; ++part)
      outputs.push_back(ember::linear(x, weights[part], std::nullopt, formats[part]));
    at::Tensor y = at::cat(outputs, 1);
    if (const auto bias = biases.get(slot)) y.add_(*bias);
    return y;
  }
};

// The LoRA adapters over the layer's linears, for a step where some rows run one (rows: each row's
// slot, -1 for none): per linear its A and B stacks and ranks (three entries of weights, as
// layers/lora.py's LoRALinear holds them) and its parts' rows (as many as its ranks' columns);
// one scale per slot. Each linear's output gets its delta (lora_add_) before anything reads it.
struct LayerAdapters {
  const std::optional<at::Tensor>& rows;
  at::TensorList weights;
  at::ArrayRef<double> scales;
  at::IntArrayRef part_rows;

  void add(int64_t slot, const at::Tensor& y, const at::Tensor& x) const {
    if (!rows) return;
    int64_t first = 0;
    for (int64_t s = 0; s < slot; ++s) first += weights[3 * s + 2].size(1);
    ember::lora_add_(y, x, weights[3 * slot], weights[3 * slot + 1], *rows, scales,
                     part_rows.slice(first, weights[3 * slot + 2].size(1)), weights[3 * slot + 2]);
  }
};

// hidden [tokens, hidden_size] is the residual stream, updated in place:
//   hidden += norm_attn_out(o(attention(rotary(qk_norm(qkv(norm_attn_in(hidden)))))))
//   hidden += norm_mlp_out(down(act_and_mul(gate_up(norm_mlp_in(hidden)))))
// where an absent norm passes its input through. biases and parts: per linear, qkv, o, gate_up, down,
// or only qkv and o for the first line alone (a mixture of experts' layer); weights and formats: per
// part (LayerLinears); a format is ember::linear's code (ops.h). Each token is its own sequence's
// decode. Rotary turns the first cos.size(1) dims of each q and k head. lora_*: LayerAdapters, with
// lora_rows None for a step without adapters. stage kAttentionPart or kMlpPart (a tensor-parallel
// rank's, models/decoder.py): run that line alone up to o's or down's output, written to partial
// instead of added to hidden.
void decoder_layer_(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& norms, double eps,
                    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef formats,
                    at::IntArrayRef parts, bool gelu, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                    const at::Tensor& context_lens, int64_t num_heads, double scale, double softcap, int64_t window,
                    const std::optional<at::Tensor>& lora_rows, at::TensorList lora_weights, at::ArrayRef<double> lora_scales,
                    at::IntArrayRef lora_part_rows, int64_t stage, const std::optional<at::Tensor>& partial) {
  const int64_t linears = static_cast<int64_t>(parts.size());
  int64_t all_parts = 0;
  for (const int64_t count : parts) {
    TORCH_CHECK(count >= 1, "decoder_layer_: every linear has at least one part, got ", parts);
    all_parts += count;
  }
  TORCH_CHECK((linears == kLinears || linears == kAttentionLinears) && static_cast<int64_t>(biases.size()) == linears,
              "decoder_layer_: parts and biases must each hold qkv, o, gate_up and down (or qkv and o), got ",
              parts.size(), " and ", biases.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == all_parts && static_cast<int64_t>(formats.size()) == all_parts,
              "decoder_layer_: weights and formats must hold a part each (", all_parts, "), got ", weights.size(),
              " and ", formats.size());
  const LayerLinears linear{weights, biases, formats, parts};
  TORCH_CHECK(!lora_rows || static_cast<int64_t>(lora_weights.size()) == 3 * linears,
              "decoder_layer_: lora_weights must hold A, B and ranks for each linear, got ", lora_weights.size());
  const LayerAdapters adapters{lora_rows, lora_weights, lora_scales, lora_part_rows};
  TORCH_CHECK(stage >= kWholeLayer && stage <= kMlpPart && (stage == kWholeLayer) != partial.has_value() &&
                  (stage != kMlpPart || linears == kLinears),
              "decoder_layer_: stage ", stage, " takes partial only for a rank's part (1: attention, 2: the MLP, ",
              "with its linears)");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == kNorms, "decoder_layer_: norms must hold ", kNorms,
              " entries (attention in/out, mlp in/out, q, k; None where absent), got ", norms.size());
  TORCH_CHECK(hidden.dim() == 2 && key_cache.dim() == 4, "decoder_layer_: hidden must be [tokens, hidden_size] ",
              "and the caches [num_blocks, block_size, kv_heads, head_dim], got ", hidden.sizes(), " and ",
              key_cache.sizes());
  // An 8-bit cache's rows end in their scale (kv_quant.h).
  const int64_t tokens = hidden.size(0), kv_heads = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3) - (is_quantized_cache(key_cache.scalar_type()) ? kScaleBytes : 0);
  const auto attention_out = [&]() {
    const at::Tensor attention_in = normed(hidden, norms.get(kAttentionIn), eps);
    const at::Tensor qkv = linear(0, attention_in);
    adapters.add(0, qkv, attention_in);
    TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kv_heads) * head_dim, "decoder_layer_: the qkv projection gives ",
                qkv.size(1), " columns, expected (", num_heads, " + 2 * ", kv_heads, ") * ", head_dim);
    if (const auto q_norm = norms.get(kQuery)) norm_heads_(qkv.narrow(1, 0, num_heads * head_dim), num_heads, head_dim, *q_norm, eps);
    if (const auto k_norm = norms.get(kKey))
      norm_heads_(qkv.narrow(1, num_heads * head_dim, kv_heads * head_dim), kv_heads, head_dim, *k_norm, eps);
    const at::Tensor heads = qkv.view({tokens, num_heads + 2 * kv_heads, head_dim});
    ember::rotary_(heads.narrow(1, 0, num_heads + kv_heads).narrow(2, 0, cos.size(1)), cos, sin);
    ember::write_kv_cache_(key_cache, value_cache, slot_mapping, heads.narrow(1, num_heads, kv_heads),
                           heads.narrow(1, num_heads + kv_heads, kv_heads));
    const at::Tensor attention = ember::paged_decode_attention(heads.narrow(1, 0, num_heads), key_cache, value_cache,
                                                               block_tables, context_lens, scale, softcap, window);
    const at::Tensor attention_rows = attention.view({tokens, num_heads * head_dim});
    const at::Tensor out = linear(1, attention_rows);
    adapters.add(1, out, attention_rows);
    return out;
  };
  const auto mlp_out = [&]() {
    const at::Tensor mlp_in = normed(hidden, norms.get(kMlpIn), eps);
    const at::Tensor gate_up = linear(2, mlp_in);
    adapters.add(2, gate_up, mlp_in);
    const at::Tensor activated = gelu ? ember::gelu_tanh_and_mul(gate_up) : ember::silu_and_mul(gate_up);
    const at::Tensor out = linear(3, activated);
    adapters.add(3, out, activated);
    return out;
  };
  if (stage == kAttentionPart) {
    partial->copy_(attention_out());
    return;
  }
  if (stage == kMlpPart) {
    partial->copy_(mlp_out());
    return;
  }
  hidden.add_(normed(attention_out(), norms.get(kAttentionOut), eps));
  if (linears == kAttentionLinears) return;
  hidden.add_(normed(mlp_out(), norms.get(kMlpOut), eps));
}

}  // namespace

namespace ember {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  int64_t format) {
  if (format >= kInt8Arithmetic) return int8_linear(x, weight, bias, format - kInt8Arithmetic, x.size(1));
  if (x.scalar_type() == at::kBFloat16)
    return format == kPlainWeight ? bf16_linear(x, weight.view(at::kByte), bias, kBF16, x.size(1))
                                  : bf16_linear(x, weight, bias, format, x.size(1));
  if (format == kPlainWeight) return small_batch_linear(x, weight, bias);
  return gguf_block_linear(x, weight, bias, format, x.size(1));
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def(
      "decoder_layer_(Tensor(a!) hidden, Tensor?[] norms, float eps, Tensor[] weights, Tensor?[] biases, "
      "int[] formats, int[] parts, bool gelu, Tensor cos, Tensor sin, Tensor(b!) key_cache, Tensor(c!) value_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int num_heads, float scale, float softcap, "
      "int window, Tensor? lora_rows, Tensor[] lora_weights, float[] lora_scales, int[] lora_part_rows, "
      "int stage=0, Tensor(d!)? partial=None) -> ()");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("decoder_layer_", &decoder_layer_); }
