// A step's new K/V rows into their slots of the paged cache, both caches in one call: a row copy per
// token. Two index_copy_ calls through the dispatcher cost ~10x more at decode sizes. A float32
// model may keep a float16 or bfloat16 cache: its rows are then rounded as `.to(cache dtype)` does.
// An 8-bit cache (int8 or e4m3, kv_quant.h) takes rows of any float dtype, each head rotated and
// quantized.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kv_quant.h"
#include "ops.h"

namespace {

bool is_float(at::ScalarType rows) { return rows == at::kFloat || rows == at::kBFloat16 || rows == at::kHalf; }

// [tokens, kv_heads, head_dim] with each token's heads contiguous (rows may be strided: the k/v
// columns of a fused QKV output).
void check_rows(const at::Tensor& rows, const at::Tensor& cache, const char* name) {
  const bool quantized = is_quantized_cache(cache.scalar_type());
  const int64_t head_dim = cache.size(3) - (quantized ? kScaleBytes : 0);
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == head_dim,
              "write_kv_cache_: ", name, " must be [tokens, ", cache.size(2), ", ", head_dim, "], got ",
              rows.sizes());
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == rows.size(2), "write_kv_cache_: each token's ", name,
              " heads must be contiguous, got strides ", rows.strides());
  const bool rounded = rows.scalar_type() == at::kFloat &&
                       (cache.scalar_type() == at::kHalf || cache.scalar_type() == at::kBFloat16);
  TORCH_CHECK((rows.scalar_type() == cache.scalar_type() || rounded || (quantized && is_float(rows.scalar_type()))) &&
                  rows.device() == cache.device(),
              "write_kv_cache_: ", name, " must be on the cache's device, in its dtype (or float32 for a float16 or "
              "bfloat16 cache, any float dtype for an 8-bit cache), got ", rows.scalar_type(), " for a ",
              cache.scalar_type(), " cache");
}

// Each token's heads quantized into their rows (kv_quant.h), from rows of float dtype In.
template <typename In, typename T>
void write_quantized(const at::Tensor& key_cache, const at::Tensor& value_cache, const int64_t* slots,
                     const at::Tensor& key, const at::Tensor& value) {
  const int64_t kv_heads = key_cache.size(2), row = key_cache.size(3), head_dim = row - kScaleBytes;
  std::vector<float> widened(head_dim);
  const std::pair<const at::Tensor*, const at::Tensor*> pairs[] = {{&key, &key_cache}, {&value, &value_cache}};
  for (const auto& [rows, cache] : pairs) {
    const In* in = rows->template data_ptr<In>();
    T* out = static_cast<T*>(cache->data_ptr());
    for (int64_t t = 0; t < rows->size(0); ++t)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const In* head = in + t * rows->stride(0) + h * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) widened[i] = static_cast<float>(head[i]);
        rotate_row(widened.data(), head_dim);
        quantize_row(widened.data(), head_dim, out + (slots[t] * kv_heads + h) * row);
      }
  }
}

template <typename T>
void write_quantized_from(const at::Tensor& key_cache, const at::Tensor& value_cache, const int64_t* slots,
                          const at::Tensor& key, const at::Tensor& value) {
  switch (key.scalar_type()) {
    case at::kFloat: return write_quantized<float, T>(key_cache, value_cache, slots, key, value);
    case at::kBFloat16: return write_quantized<c10::BFloat16, T>(key_cache, value_cache, slots, key, value);
    default: return write_quantized<c10::Half, T>(key_cache, value_cache, slots, key, value);
  }
}

template <typename T>
void write_rounded(const at::Tensor& key_cache, const at::Tensor& value_cache, const int64_t* slots,
                   const at::Tensor& key, const at::Tensor& value) {
  const int64_t row_size = key_cache.size(2) * key_cache.size(3);
  const std::pair<const at::Tensor*, const at::Tensor*> pairs[] = {{&key, &key_cache}, {&value, &value_cache}};
  for (const auto& [rows, cache] : pairs) {
    const float* in = rows->template data_ptr<float>();
    T* out = cache->template data_ptr<T>();
    for (int64_t t = 0; t < rows->size(0); ++t)
      for (int64_t i = 0; i < row_size; ++i) out[slots[t] * row_size + i] = static_cast<T>(in[t * rows->stride(0) + i]);
  }
}

}  // namespace

namespace ember {

void write_kv_cache_(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.scalar_type() == value_cache.scalar_type() &&
                  key_cache.is_cpu() && value_cache.is_cpu(),
              "write_kv_cache_: the caches must be contiguous CPU tensors [num_blocks, block_size, kv_heads, "
              "head_dim] of one dtype, got ", key_cache.sizes(), " and ", value_cache.sizes());
  check_rows(key, key_cache, "key");
  check_rows(value, key_cache, "value");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "write_kv_cache_: key and value must share a dtype, got ",
              key.scalar_type(), " and ", value.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.is_cpu() && slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "write_kv_cache_: slot_mapping must be a contiguous int64 CPU tensor of one slot per token, got ",
              slot_mapping.sizes(), " for ", key.size(0), " tokens");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row_bytes = key_cache.size(2) * key_cache.size(3) * key_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_cache_: slot_mapping[", t, "] = ", slots[t],
                " is outside the cache's ", num_slots, " slots");
  if (key_cache.scalar_type() == at::kChar) {
    write_quantized_from<int8_t>(key_cache, value_cache, slots, key, value);
  } else if (key_cache.scalar_type() == at::kFloat8_e4m3fn) {
    write_quantized_from<c10::Float8_e4m3fn>(key_cache, value_cache, slots, key, value);
  } else if (key.scalar_type() == key_cache.scalar_type()) {  // value's dtype is key's (checked above)
    auto* key_out = static_cast<char*>(key_cache.data_ptr());
    auto* value_out = static_cast<char*>(value_cache.data_ptr());
    const auto* key_in = static_cast<const char*>(key.data_ptr());
    const auto* value_in = static_cast<const char*>(value.data_ptr());
    const int64_t key_stride = key.stride(0) * key.element_size(), value_stride = value.stride(0) * value.element_size();
    for (int64_t t = 0; t < key.size(0); ++t) {
      std::memcpy(key_out + slots[t] * row_bytes, key_in + t * key_stride, row_bytes);
      std::memcpy(value_out + slots[t] * row_bytes, value_in + t * value_stride, row_bytes);
    }
  } else if (key_cache.scalar_type() == at::kHalf) {
    write_rounded<c10::Half>(key_cache, value_cache, slots, key, value);
  } else {
    write_rounded<c10::BFloat16>(key_cache, value_cache, slots, key, value);
  }
}

}  // namespace ember

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("write_kv_cache_(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("write_kv_cache_", &ember::write_kv_cache_); }
