"""Rotary position embeddings in Hugging Face's rotate_half layout: dimension i pairs with i + head_dim / 2."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ember_core.kernels import cpu_ops

RopeKind = Literal["linear", "llama3"]


@dataclass(frozen=True)
class RopeScaling:
    kind: RopeKind
    factor: float
    # llama3 only: frequencies between the two wavelengths are interpolated, longer ones divided by factor.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None) -> RopeScaling | None:
        """HF `rope_scaling` / `rope_parameters` (old and new spellings); None for plain RoPE."""
        kind = (params or {}).get("rope_type", (params or {}).get("type", "default"))
        if kind == "default":
            return None
        if kind == "linear":
            return cls("linear", float(params["factor"]))
        if kind == "llama3":
            return cls(
                "llama3",
                float(params["factor"]),
                float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                int(params["original_max_position_embeddings"]),
            )
        raise ValueError(f"unsupported rope scaling type {kind!r}; ember supports 'default', 'linear' and 'llama3'")


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    freq_factors: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Float32 inverse frequencies [head_dim / 2], computed with the same ops as transformers so fp32 matches bit for bit.

    freq_factors are llama.cpp's per-frequency divisors (GGUF `rope_freqs`), its encoding of llama3 scaling.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_tokens, head_dim] for arbitrary per-token positions, computed in float32."""
    freqs = positions[:, None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim]; cos / sin [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope into x itself (a strided view is fine) and return it; one C++ call, with the same
    bits, on float32 CPU tensors (bfloat16: rounded once, not after each product), where the torch ops
    above cost ~10x more at decode sizes."""
    if x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu and cos.dtype == x.dtype and cpu_ops.is_available():
        cpu_ops.ops().rotary_(x, cos.contiguous(), sin.contiguous())
        return x
    return x.copy_(apply_rope(x, cos, sin))
