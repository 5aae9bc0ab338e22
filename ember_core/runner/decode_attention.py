"""Which path a model runner's decodes attend through, decided once at start: ember's C++ kernel
(CPU), FlexAttention over the paged cache (other devices, CUDA first), or SDPA over gathered
blocks, which runs anywhere."""

from __future__ import annotations

import logging

import torch

from ember_core.config import DecodeAttention
from ember_core.kernels import cpu_ops
from ember_core.layers.attention import PagedAttention, decode_key_mask, gathered_decode_attention
from ember_core.layers.flex_decode import decode_block_mask, flex_decode_attention

logger = logging.getLogger(__name__)


def choose_decode_attention(requested: DecodeAttention, layers: list[PagedAttention], dtype: torch.dtype) -> DecodeAttention:
    """The layers' caches are allocated; "auto" picks the fastest path that works here."""
    layer = layers[0]
    cache = layer.key_cache
    if requested == "kernel":
        if not (cache.is_cpu and cpu_ops.decode_attention_supports(dtype, cache.dtype)):
            raise ValueError(
                f"decode_attention 'kernel' needs ember's C++ ops on the CPU for a {dtype} model over a {cache.dtype} "
                f"KV cache; here: device {cache.device}, {cpu_ops.unavailable_reason() or 'ops built'}"
            )
        return "kernel"
    if requested == "flex":
        problem = _flex_unsupported(layers) or flex_decode_problem(layer, dtype)
        if problem:
            raise ValueError(f"decode_attention 'flex' does not work here: {problem}")
        return "flex"
    if requested == "sdpa":
        return "sdpa"
    if cache.is_cpu:
        if not cpu_ops.is_available():
            logger.warning(
                "ember's C++ CPU ops are unavailable (%s): attention, linears and norms fall back to torch ops, "
                "several times slower",
                cpu_ops.unavailable_reason(),
            )
            return "sdpa"
        if not cpu_ops.decode_attention_supports(dtype, cache.dtype):
            logger.warning(
                "the decode-attention kernel does not take a %s model over a %s KV cache: decodes use SDPA over "
                "gathered blocks, several times slower",
                dtype, cache.dtype,
            )
            return "sdpa"
        return "kernel"
    problem = _flex_unsupported(layers) or flex_decode_problem(layer, dtype)
    if problem:
        logger.warning("FlexAttention decode is unavailable (%s): decodes use SDPA over gathered blocks", problem)
        return "sdpa"
    return "flex"


def _flex_unsupported(layers: list[PagedAttention]) -> str | None:
    if any(layer.sliding_window is not None or layer.softcap is not None for layer in layers):
        return "ember's FlexAttention decode has no sliding windows or soft-capped logits yet"
    return None


def flex_decode_problem(layer: PagedAttention, dtype: torch.dtype) -> str | None:
    """Why FlexAttention decode cannot serve this layer (None when it can): it is compiled and
    checked against SDPA on a few of the layer's blocks, filled with noise for the check and then
    cleared. This also compiles the bucket of up to four rows before the first request."""
    key_cache, value_cache = layer.key_cache, layer.value_cache
    if key_cache.dtype != dtype:
        return f"it needs the KV cache in the model's dtype ({dtype}), not {key_cache.dtype}"
    num_blocks, block_size = key_cache.shape[:2]
    if num_blocks < 3:
        return f"the check needs 3 cache blocks, the cache has {num_blocks}"
    device = key_cache.device
    generator = torch.Generator(device="cpu").manual_seed(0)
    context_lens = torch.tensor([1, block_size, block_size + 1], dtype=torch.int32, device=device)
    block_tables = torch.tensor([[2, 0], [1, 0], [0, 2]], dtype=torch.int32, device=device)
    query = torch.randn(3, layer.num_heads, layer.head_dim, generator=generator).to(device, dtype)
    with torch.inference_mode():  # as steps run: a compile in grad mode would not be reused
        try:
            for cache in (key_cache, value_cache):
                cache[:3] = torch.randn(cache[:3].shape, generator=generator).to(device, dtype)
            got = flex_decode_attention(
                query, key_cache, value_cache, decode_block_mask(block_tables, context_lens, num_blocks, block_size), layer.scale
            )
            want = gathered_decode_attention(
                query, key_cache, value_cache, block_tables, decode_key_mask(context_lens, 2, block_size), layer.scale
            )
            tolerance = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
        except Exception as error:  # noqa: BLE001 - any failure to compile or to match means: do not use it
            return f"{type(error).__name__}: {error}".splitlines()[0]
        finally:
            key_cache[:3] = 0
            value_cache[:3] = 0
    return None
