// A whole Llama decoder layer of a decode step as one call (float32 or bfloat16, CPU), composed of ember's
// other ops in the order models/llama.py calls them, so its outputs are bit-identical to the
// layer's modules. At batch 1 the layer's ~20 eager ops and module calls cost ~4 ms of a ~20 ms
// step in Python and dispatch; from here each op is a plain C++ call.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "gguf_blocks.h"
#include "ops.h"

namespace {

constexpr int64_t kPlainWeight = -1;  // a linear's format code for an [out, in] weight in hidden's dtype
constexpr int64_t kLinears = 4;  // qkv, o, gate_up, down

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  int64_t format) {
  if (x.scalar_type() == at::kBFloat16)
    return format == kPlainWeight ? ember::bf16_linear(x, weight.view(at::kByte), bias, kBF16, x.size(1))
                                  : ember::bf16_linear(x, weight, bias, format, x.size(1));
  if (format == kPlainWeight) return ember::small_batch_linear(x, weight, bias);
  return ember::gguf_block_linear(x, weight, bias, format, x.size(1));
}

// hidden [tokens, hidden_size] is the residual stream, updated in place:
//   hidden += o(attention(rotary(qkv(norm1(hidden)))));  hidden += down(silu_and_mul(gate_up(norm2(hidden))))
// weights / biases / formats: qkv, o, gate_up, down; a format is a GGUF block format code
// (gguf_blocks.h) or -1 for a weight in hidden's dtype. Each token is its own sequence's decode.
void llama_decode_layer_(const at::Tensor& hidden, const at::Tensor& input_norm_weight,
                         const at::Tensor& post_attention_norm_weight, double eps, at::TensorList weights,
                         const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef formats,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t num_heads, double scale) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kLinears && static_cast<int64_t>(biases.size()) == kLinears &&
                  static_cast<int64_t>(formats.size()) == kLinears,
              "llama_decode_layer_: weights, biases and formats must each hold qkv, o, gate_up and down, got ",
              weights.size(), ", ", biases.size(), " and ", formats.size());
  TORCH_CHECK(hidden.dim() == 2 && key_cache.dim() == 4, "llama_decode_layer_: hidden must be [tokens, hidden_size] ",
              "and the caches [num_blocks, block_size, kv_heads, head_dim], got ", hidden.sizes(), " and ",
              key_cache.sizes());
  const int64_t tokens = hidden.size(0), kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const at::Tensor qkv = linear(ember::rms_norm(hidden, input_norm_weight, eps), weights[0], biases.get(0), formats[0]);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kv_heads) * head_dim, "llama_decode_layer_: the qkv projection gives ",
              qkv.size(1), " columns, expected (", num_heads, " + 2 * ", kv_heads, ") * ", head_dim);
  const at::Tensor heads = qkv.view({tokens, num_heads + 2 * kv_heads, head_dim});
  ember::rotary_(heads.narrow(1, 0, num_heads + kv_heads), cos, sin);
  ember::write_kv_cache_(key_cache, value_cache, slot_mapping, heads.narrow(1, num_heads, kv_heads),
                         heads.narrow(1, num_heads + kv_heads, kv_heads));
  const at::Tensor attention = ember::paged_decode_attention(heads.narrow(1, 0, num_heads), key_cache, value_cache,
                                                             block_tables, context_lens, scale);
  hidden.add_(linear(attention.view({tokens, num_heads * head_dim}), weights[1], biases.get(1), formats[1]));
  const at::Tensor gate_up =
      linear(ember::rms_norm(hidden, post_attention_norm_weight, eps), weights[2], biases.get(2), formats[2]);
  hidden.add_(linear(ember::silu_and_mul(gate_up), weights[3], biases.get(3), formats[3]));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def(
      "llama_decode_layer_(Tensor(a!) hidden, Tensor input_norm_weight, Tensor post_attention_norm_weight, "
      "float eps, Tensor[] weights, Tensor?[] biases, int[] formats, Tensor cos, Tensor sin, Tensor(b!) key_cache, "
      "Tensor(c!) value_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int num_heads, "
      "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("llama_decode_layer_", &llama_decode_layer_); }
