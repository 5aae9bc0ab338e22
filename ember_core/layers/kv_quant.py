"""The 8-bit KV cache in torch: what ember's C++ kernels do (ember_core/kernels/kv_quant.h), for the
paths that run without them (another device, or the ops unbuilt) and as the tests' reference.

A cache row is one token's K (or V) of one KV head, rotated by a normalized Walsh-Hadamard matrix:
head_dim int8 or e4m3 codes, then the float16 scale (2 bytes) they are multiplied by, absmax / 127 or
absmax / 448, one per token and head. Dequantizing rotates back (the rotation is its own inverse).
"""

from __future__ import annotations

import math

import torch

from ember_core.device import resolve_dtype

QUANTIZED_KV_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_BYTES = 2
_CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache dtype `--kv-cache-dtype` names (auto: the model's)."""
    if name == "auto":
        return model_dtype
    return QUANTIZED_KV_DTYPES.get(name) or resolve_dtype(name, device)


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The `--kv-cache-dtype` value that names a cache dtype (float8_e4m3fn: "fp8_e4m3")."""
    return next((name for name, quantized in QUANTIZED_KV_DTYPES.items() if quantized == dtype), str(dtype).removeprefix("torch."))


def is_quantized(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in _CODE_MAX


def cache_row(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements one token's head takes in a cache of this dtype."""
    return head_dim + SCALE_BYTES if is_quantized(cache_dtype) else head_dim


def rotate(rows: torch.Tensor) -> torch.Tensor:
    """float32 [..., head_dim] times the normalized Walsh-Hadamard matrix (block-diagonal, blocks of
    head_dim's largest power-of-two divisor): kv_quant.h's rotate_row, butterfly for butterfly."""
    head_dim = rows.shape[-1]
    block = head_dim & -head_dim
    if block == 1:
        return rows
    half = 1
    while half < block:
        pairs = rows.reshape(*rows.shape[:-1], head_dim // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        rows = torch.stack((a + b, a - b), dim=-2).reshape(*rows.shape)
        half *= 2
    return rows * (1.0 / math.sqrt(block))


def quantize(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] floats as [..., head_dim + 2] rows of their rotation's codes and its scale."""
    code_max = _CODE_MAX[cache_dtype]
    widened = rotate(rows.float())
    scale = (widened.abs().amax(dim=-1, keepdim=True) / code_max).half()
    step = scale.float()
    # The float16 scale may round down: clamp the few codes that would pass the top.
    x = torch.where(step > 0, (widened / step.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-code_max, code_max), 0.0)
    codes = x.round().to(torch.int8) if cache_dtype == torch.int8 else x.to(cache_dtype).view(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1).view(cache_dtype)


def dequantize(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 2] rows back as [..., head_dim] values of `dtype`, rotated back."""
    head_dim = cache_rows.shape[-1] - SCALE_BYTES
    scale = cache_rows[..., head_dim:].view(torch.int8).contiguous().view(torch.float16).float()
    return rotate(cache_rows[..., :head_dim].float() * scale).to(dtype)


def widen(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as values of `dtype`: dequantized from an 8-bit cache, else converted."""
    return dequantize(cache_rows, dtype) if is_quantized(cache_rows.dtype) else cache_rows.to(dtype)
