// ember's C++ CPU ops as C++ functions, so one op can call another directly (decoder_layer.cpp);
// each is also registered as torch.ops.<EMBER_OPS>.<name> by the file that defines it.
#pragma once

// The torch op namespace of this build: one per instruction set (cpu_ops.py passes
// -DEMBER_OPS=ember_<name>), so the builds of several instruction sets load side by side.
#ifndef EMBER_OPS
#error "build through ember_core/kernels/cpu_ops.py, which defines EMBER_OPS"
#endif

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace ember {

// A linear's format code for an [out, in] weight in x's dtype; other codes are GGUF block formats (gguf_blocks.h),
// with kInt8Arithmetic added where the linear runs the fast numerics' int8 kernel (int8_linear) on them.
constexpr int64_t kPlainWeight = -1;
constexpr int64_t kInt8Arithmetic = 256;

// bf16_linear.cpp
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                       int64_t format, int64_t in_features);

// decoder_layer.cpp: y = x W^T + b on the kernel for x's dtype (float32 or bfloat16) and W's format code.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t format);

// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rms_norm_(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up);

// int8_linear.cpp: the fast numerics' linear over GGUF blocks, x (float32 or bfloat16) quantized to int8.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                       int64_t format, int64_t in_features);
// Rows of float32, bfloat16 or float16 weights as Q8_0 blocks, as llama.cpp's quantize_row_q8_0 makes them.
at::Tensor quantize_q8_0(const at::Tensor& weight);

// kv_cache.cpp
void write_kv_cache_(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& key, const at::Tensor& value);

// lora.cpp: y += each row's LoRA delta, by its adapter's slot (lora_add_ in the op namespace).
void lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& row_slots, at::ArrayRef<double> scales, at::IntArrayRef part_rows, const at::Tensor& ranks);

// paged_decode.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  double softcap, int64_t window);

// small_batch_linear.cpp
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor gguf_block_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                             int64_t format, int64_t in_features);
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t format, int64_t in_features);

}  // namespace ember
