"""Rotary position embeddings in Hugging Face's rotate_half layout: dimension i pairs with i + rotary_dim / 2.

Every kind computes its float32 inverse frequencies with the ops of transformers' `ROPE_INIT_FUNCTIONS`,
in the same order, and cos / sin as transformers' rotary embedding modules do, so both match bit for
bit in float32 (and in bfloat16 after the one cast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ember_core.kernels import cpu_ops

RopeKind = Literal["linear", "llama3", "yarn", "longrope"]
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    kind: RopeKind
    factor: float
    # llama3 only: frequencies between the two wavelengths are interpolated, longer ones divided by factor.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only: the ramp from extrapolated to interpolated frequencies spans the dims that turn
    # between beta_fast and beta_slow times over the original context (truncate: at whole dims).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn and longrope: cos and sin are multiplied by it; resolved from mscale / the factor when parsed.
    attention_factor: float = 1.0
    # longrope only: per-frequency divisors; the long ones for tokens beyond the original context.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, max_position_embeddings: int | None = None) -> RopeScaling | None:
        """One layer's HF `rope_scaling` / `rope_parameters` (old and new spellings); None for plain RoPE.

        max_position_embeddings is the config's: yarn and longrope without a `factor` (and without
        `original_max_position_embeddings`) fall back on it as transformers does.
        """
        params = params or {}
        kind = _scaling_kind(params)
        if kind == "default":
            return None
        if kind == "linear":
            return cls("linear", float(_required(params, "factor", kind)))
        if kind == "llama3":
            return cls(
                "llama3",
                float(_required(params, "factor", kind)),
                float(_required(params, "low_freq_factor", kind)),
                float(_required(params, "high_freq_factor", kind)),
                int(_required(params, "original_max_position_embeddings", kind)),
            )
        original = params.get("original_max_position_embeddings")
        factor = params.get("factor")
        if (original is None or factor is None) and max_position_embeddings is None:
            raise ValueError(f"{kind} rope scaling needs 'factor' and 'original_max_position_embeddings', or the "
                             f"config's max_position_embeddings to stand in for them; got {sorted(params)}")
        if original is None:
            original = max_position_embeddings
        if factor is None:  # Phi-3, DeepSeek: the ratio of the two context lengths
            factor = max_position_embeddings / original
        if kind == "yarn":
            return cls._yarn(params, float(factor), int(original))
        return cls._longrope(params, float(factor), int(original))

    @classmethod
    def _yarn(cls, params: dict[str, Any], factor: float, original: int) -> RopeScaling:
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:  # DeepSeek: the ratio of two mscales
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return cls(
            "yarn",
            factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32),  # `or`: transformers takes 0 / None as unset
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention_factor),
        )

    @classmethod
    def _longrope(cls, params: dict[str, Any], factor: float, original: int) -> RopeScaling:
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return cls(
            "longrope",
            factor,
            original_max_position_embeddings=original,
            attention_factor=float(attention_factor),
            short_factor=tuple(float(f) for f in _required(params, "short_factor", "longrope")),
            long_factor=tuple(float(f) for f in _required(params, "long_factor", "longrope")),
        )


def _scaling_kind(params: dict[str, Any]) -> str:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "su" or (kind == "yarn" and "long_factor" in params):
        return "longrope"  # older Phi-3 spellings of LongRoPE, which transformers' Phi3Config renames
    supported = ", ".join(map(repr, SUPPORTED_ROPE_TYPES))
    if kind == "dynamic":
        raise ValueError(
            "unsupported rope scaling type 'dynamic': its frequencies depend on the sequence length, so a token's "
            f"rotation would depend on its batch; ember supports {supported}"
        )
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r}; ember supports {supported}")
    return kind


def _required(params: dict[str, Any], key: str, kind: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"{kind} rope scaling needs {key!r}, got {sorted(params)}")
    return params[key]


def _yarn_mscale(factor: float, mscale: float = 1) -> float:
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def hf_rope_parameters(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """One layer type's RoPE parameters from an HF config dict, flat as transformers 5 writes them
    (rope_type, rope_theta, partial_rotary_factor and the scaling's keys).

    Reads transformers 5's `rope_parameters`, which Gemma 3 nests per layer type
    ({"sliding_attention": {...}, "full_attention": {...}}), and the older top-level `rope_theta`,
    `rope_scaling` and `partial_rotary_factor`. A top-level `original_max_position_embeddings` (Phi-3)
    wins over the one inside, and Gemma 3's older `rope_local_base_freq` gives sliding layers plain
    RoPE with that theta while the scaling stays with full-attention layers, as transformers reads them.
    """
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    nested = bool(raw) and all(value is None or isinstance(value, dict) for value in raw.values())
    if nested:
        if layer_type is None:
            raise ValueError(f"the config's RoPE parameters differ per layer type ({', '.join(raw)}); name one")
        if raw.get(layer_type) is None:
            raise ValueError(
                f"the config has no RoPE parameters for layer type {layer_type!r}, only for {', '.join(raw)}"
            )
        params = dict(raw[layer_type])
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        params = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    else:
        params = dict(raw)
        if cfg.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    params.setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_THETA))
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    return params


def rope_inv_freq(
    rotary_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    freq_factors: tuple[float, ...] | None = None,
    long: bool = False,
) -> torch.Tensor:
    """Float32 inverse frequencies [rotary_dim / 2], with the same ops as transformers so fp32 matches bit for bit.

    freq_factors are llama.cpp's per-frequency divisors (GGUF `rope_freqs`), its encoding of llama3 scaling.
    long: LongRoPE's table for tokens beyond the original context (other kinds have one table).
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rotary_dim
    if scaling is not None and scaling.kind in ("yarn", "longrope"):
        if freq_factors is not None:
            raise ValueError(f"GGUF rope_freqs cannot combine with {scaling.kind} scaling")
        wavelength_factors = theta**exponents  # 1 / the plain inverse frequencies
        if scaling.kind == "yarn":
            return _yarn_inv_freq(rotary_dim, theta, scaling, wavelength_factors)
        divisors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float)
        return 1.0 / (divisors * wavelength_factors)
    inv_freq = 1.0 / (theta**exponents)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    rotary_dim: int, theta: float, scaling: RopeScaling, wavelength_factors: torch.Tensor
) -> torch.Tensor:
    extrapolated = 1.0 / wavelength_factors
    interpolated = 1.0 / (scaling.factor * wavelength_factors)
    low, high = _yarn_correction_range(rotary_dim, theta, scaling)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    # 1 - (1 - ramp) is not always ramp in float32: keep transformers' two subtractions.
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def _yarn_correction_range(rotary_dim: int, theta: float, scaling: RopeScaling) -> tuple[float, float]:
    """The dims (in frequency index units) where the ramp starts and ends."""

    def dim_turning(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_turning(scaling.beta_fast), dim_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_tokens, rotary_dim] for arbitrary per-token positions, computed in float32 and
    scaled by attention_factor before the cast, as transformers does. inv_freq is [rotary_dim / 2], or
    [num_tokens, rotary_dim / 2] for a table per token."""
    freqs = positions[:, None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


@dataclass(frozen=True)
class Rope:
    """How one layer rotates its query and key heads: the first rotary_dim of head_dim dims turn
    (partial rotary below head_dim; none with rotary_dim 0), the rest pass through.

    Equal Ropes make equal tables and hash alike, so a decoder computes `cos_sin` once per step for
    each distinct Rope (one per Gemma 3 layer type, one for most models), not once per layer.
    """

    head_dim: int
    rotary_dim: int
    theta: float
    scaling: RopeScaling | None = None
    freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs`: per-frequency divisors
    # (short, long or None) inverse frequencies per device, computed once on the CPU as transformers does.
    _inv_freq_by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # Decoders look each layer's table up by its Rope every step: LongRoPE's factors are hashed once, here.
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim must be even and within head_dim {self.head_dim}, got {self.rotary_dim}")
        tables = {"rope_freqs": self.freq_factors}
        if self.scaling is not None and self.scaling.kind == "longrope":
            tables.update(short_factor=self.scaling.short_factor, long_factor=self.scaling.long_factor)
        for name, values in tables.items():
            if values is not None and len(values) != self.rotary_dim // 2:
                raise ValueError(f"{name} has {len(values)} entries, expected rotary_dim / 2 = {self.rotary_dim // 2}")
        fields = (self.head_dim, self.rotary_dim, self.theta, self.scaling, self.freq_factors)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], layer_type: str | None = None) -> Rope:
        """The rotation of one layer type (None: of every layer) of an HF config dict; see hf_rope_parameters."""
        params = hf_rope_parameters(cfg, layer_type)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        # Granite 4.0-H's position_embedding_type: "rope", or none at all (NoPE: rotary_dim 0).
        rotates = cfg.get("position_embedding_type", "rope") == "rope"
        return cls(
            head_dim=head_dim,
            rotary_dim=int(head_dim * params.get("partial_rotary_factor", 1.0)) if rotates else 0,
            theta=float(params["rope_theta"]),
            scaling=RopeScaling.from_hf(params, cfg.get("max_position_embeddings")),
        )

    @property
    def attention_factor(self) -> float:
        return 1.0 if self.scaling is None else self.scaling.attention_factor

    @property
    def has_long_table(self) -> bool:
        return self.scaling is not None and self.scaling.kind == "longrope"

    def inv_freq(self, long: bool = False) -> torch.Tensor:
        """Float32 CPU inverse frequencies [rotary_dim / 2]; long: LongRoPE's long table."""
        return rope_inv_freq(self.rotary_dim, self.theta, self.scaling, self.freq_factors, long)

    def use_long_table(self, positions: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor | None:
        """Per token, whether LongRoPE's long table rotates it (None for other kinds): when its
        sequence's prompt (the request's, unchanged by preemption) is longer than the original
        context, or the token itself lies beyond it. transformers' generate() makes the same choice
        per forward (the prompt in one, then one token each); per token it holds in any batch."""
        if not self.has_long_table:
            return None
        original = self.scaling.original_max_position_embeddings
        return (prompt_lengths > original) | (positions >= original)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, use_long: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, rotary_dim] in dtype; LongRoPE needs use_long (see use_long_table),
        which other kinds ignore."""
        short, long = self._inv_freq_on(positions.device)
        inv_freq = short
        if long is not None:
            if use_long is None:
                raise ValueError("LongRoPE picks its table per token: pass use_long (Rope.use_long_table)")
            inv_freq = torch.where(use_long[:, None], long, short)
        return rope_cos_sin(positions, inv_freq, dtype, self.attention_factor)

    def _inv_freq_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        if device not in self._inv_freq_by_device:
            long = self.inv_freq(long=True).to(device) if self.has_long_table else None
            self._inv_freq_by_device[device] = (self.inv_freq().to(device), long)
        return self._inv_freq_by_device[device]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim]; cos / sin [num_tokens, rotary_dim]: the first rotary_dim dims
    of each head turn, the rest pass through (partial rotary, as Phi-3 / Phi-4-mini)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return _rotate(x, cos, sin)
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope into x itself (a strided view is fine) and return it; one C++ call, with the same
    bits, on float32 CPU tensors (bfloat16: rounded once, not after each product), where the torch ops
    above cost ~10x more at decode sizes."""
    if cos.shape[-1] == 0:  # no rotary dims (NoPE)
        return x
    turning = x[..., : cos.shape[-1]]  # a view: the C++ op takes its strides
    if _on_kernel(turning, cos):
        cpu_ops.ops().rotary_(turning, cos.contiguous(), sin.contiguous())
    else:
        turning.copy_(_rotate(turning, cos, sin))
    return x


def _on_kernel(x: torch.Tensor, cos: torch.Tensor) -> bool:
    if not (x.is_cpu and cos.dtype == x.dtype and cpu_ops.is_available()):
        return False
    return x.dtype in (torch.float32, torch.bfloat16)
