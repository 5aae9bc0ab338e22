"""Llama from scratch (Llama 2/3, SmolLM, TinyLlama...): RMSNorm, rotary positions, SwiGLU MLP,
grouped-query attention over the paged KV cache. q/k/v and gate/up run as one fused Linear each;
load_weights fills them from the separate HF tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.activation import silu_and_mul
from ember_core.layers.attention import AttentionMetadata, PagedAttention
from ember_core.layers.linear import SMALL_BATCH_ROWS, kernel_operands, tied_head
from ember_core.models.rotary import RopeScaling, apply_rope_, rope_cos_sin, rope_inv_freq

IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)  # saved by old transformers versions; recomputed here


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    intermediate_size: int = 11008
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs`: per-frequency divisors
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, expected {self.head_dim // 2}")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        activation = cfg.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"unsupported Llama hidden_act {activation!r}; ember supports 'silu'")
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs `rope_theta` + `rope_scaling`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float((rope or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=RopeScaling.from_hf(rope),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu and x.dim() == 2 and cpu_ops.is_available():
            return cpu_ops.ops().rms_norm(x.contiguous(), self.weight, self.eps)  # one C++ call, not ~10 ops
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # bit-identical to the lines below
        # Normalise in float32 and cast back before the weight, as transformers does, so fp16/bf16 agree.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.attn = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_and_k, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # One rotation for the query and key heads together.
        q_and_k = apply_rope_(q_and_k.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = q_and_k.flatten(1).split([self.q_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if (
            meta.decodes_only_on_kernel
            and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.shape[0] <= SMALL_BATCH_ROWS
            and self.linear_operands is not None
        ):
            return self.forward_fused_(hidden, cos, sin, meta)
        return self.forward_modules(hidden, cos, sin, meta)

    def forward_modules(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    @functools.cached_property
    def linear_operands(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...], tuple[int, ...]] | None:
        """(weights, biases, formats) of qkv, o, gate_up and down, as llama_decode_layer_ takes them;
        None when one of them is a linear it does not take. Looked up once: the module lookups cost
        ~20 us per layer, 0.6 ms of every decode step. The runner swaps the linears before the first
        step and loading copies into the same tensors, so they do not change afterwards."""
        attention, mlp = self.self_attn, self.mlp
        operands = [kernel_operands(linear) for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(operand is None for operand in operands):
            return None
        weights, biases, formats = zip(*operands)
        return weights, biases, formats

    def forward_fused_(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """forward_modules as one C++ call with the same bits (the same ops in the same order), adding
        into hidden in place; for decode steps on CPU, where the modules' eager ops cost ~20% of a step."""
        attention = self.self_attn
        weights, biases, formats = self.linear_operands
        cpu_ops.ops().llama_decode_layer_(
            hidden, self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
            weights, biases, formats, cos, sin, attention.attn.key_cache, attention.attn.value_cache,
            meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, attention.num_heads, attention.attn.scale,
        )
        return hidden


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = tied_head(self.embed_tokens)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Filled by load_weights: a model built on the meta device keeps only what it loads.
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2, dtype=torch.float32), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def fused_shards(self) -> dict[str, list[tuple[str, int]]]:
        """Fused parameter -> the HF tensors stacked in its rows, in order, with their row counts."""
        c = self.config
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return {
            "self_attn.qkv_proj": [
                ("self_attn.q_proj", q_rows),
                ("self_attn.k_proj", kv_rows),
                ("self_attn.v_proj", kv_rows),
            ],
            "mlp.gate_up_proj": [("mlp.gate_proj", c.intermediate_size), ("mlp.up_proj", c.intermediate_size)],
        }

    def _weight_slots(self) -> dict[str, tuple[torch.Tensor, slice]]:
        """Every expected checkpoint tensor (HF name without `model.`) -> the parameter rows it fills."""
        fused_shards = self.fused_shards()
        slots: dict[str, tuple[torch.Tensor, slice]] = {}
        for name, param in self.named_parameters():
            for fused, shards in fused_shards.items():
                if f".{fused}." in name:
                    start = 0
                    for shard, rows in shards:
                        slots[name.replace(fused, shard)] = (param, slice(start, start + rows))
                        start += rows
                    break
            else:
                slots[name] = (param, slice(None))
        return slots

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF Llama names (`model.layers.0.self_attn.q_proj.weight`, ..., `lm_head.weight`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # `to_empty` gave the head its own tensor
        slots = self._weight_slots()
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.endswith(IGNORED_WEIGHTS) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue  # a tied head saved anyway is the embedding again
            if name not in slots:
                raise ValueError(f"unexpected Llama weight {name!r}")
            param, rows = slots[name]
            with torch.no_grad():
                target = param[rows]
                if tensor.shape != target.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
                target.copy_(tensor)
            loaded.add(name)
        missing = slots.keys() - loaded
        if missing:
            raise ValueError(f"checkpoint is missing Llama weights: {sorted(missing)[:5]}")
        config = self.config
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, config.rope_freq_factors)
        self.inv_freq = inv_freq.to(self.embed_tokens.weight.device)
