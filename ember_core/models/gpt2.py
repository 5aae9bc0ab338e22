"""GPT-2 from scratch: learned positions, pre-LayerNorm blocks, GELU MLP, LM head tied to the embedding
(or its own `lm_head.weight` with `tie_word_embeddings: false`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember_core.layers.attention import AttentionMetadata, PagedAttention
from ember_core.layers.linear import tied_head
from ember_core.layers.lora import AdapterTarget

ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    max_position_embeddings: int = 1024
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GPT2Config:
        activation = cfg.get("activation_function", "gelu_new")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported GPT-2 activation_function {activation!r}; supported: {sorted(ACTIVATIONS)}")
        hidden = cfg.get("n_embd", 768)
        return cls(
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("n_positions", cfg.get("n_ctx", 1024)),
            hidden_size=hidden,
            num_layers=cfg.get("n_layer", 12),
            num_heads=cfg.get("n_head", 12),
            intermediate_size=cfg.get("n_inner") or 4 * hidden,
            layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            activation=activation,
            scale_attn_weights=cfg.get("scale_attn_weights", True),
            scale_attn_by_inverse_layer_idx=cfg.get("scale_attn_by_inverse_layer_idx", False),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        scale = config.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.ln_1 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn = PagedAttention(config.num_heads, config.num_heads, config.head_dim, scale)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.c_fc = nn.Linear(hidden, config.intermediate_size)
        self.mlp_proj = nn.Linear(config.intermediate_size, hidden)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(hidden)).chunk(3, dim=-1)
        hidden = hidden + self.attn_proj(self.attn(q, k, v, meta))
        return hidden + self.mlp_proj(self.act(self.c_fc(self.ln_2(hidden))))


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = tied_head(self.wte)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            hidden = block(hidden, meta)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def adapter_targets(self) -> list[AdapterTarget]:
        """The linears a LoRA adapter may adapt, the output head aside, by their checkpoint names (a
        PEFT adapter's A and B keep their usual orientation over GPT-2's transposed Conv1D weights)."""
        names = {"c_attn": "attn.c_attn", "attn_proj": "attn.c_proj", "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}
        return [
            AdapterTarget(block, attribute, [(f"transformer.h.{index}.{name}", getattr(block, attribute).out_features)])
            for index, block in enumerate(self.blocks)
            for attribute, name in names.items()
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF GPT-2 names, with or without the `transformer.` prefix; Conv1D weights are [in, out]."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight  # `to_empty` gave the head its own tensor
        params = dict(self.named_parameters())
        renames = {"attn.c_proj": "attn_proj", "mlp.c_proj": "mlp_proj", "attn.c_attn": "c_attn", "mlp.c_fc": "c_fc"}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if (name == "lm_head.weight" and self.config.tie_word_embeddings) or name.endswith(
                (".attn.bias", ".attn.masked_bias")
            ):
                continue  # a tied head saved anyway is the embedding again; causal-mask buffers
            name = name.replace("h.", "blocks.", 1) if name.startswith("h.") else name
            for old, new in renames.items():
                name = name.replace(old, new)
            if name not in params:
                raise ValueError(f"unexpected GPT-2 weight {name!r}")
            is_conv1d = name.endswith(("c_attn.weight", "attn_proj.weight", "c_fc.weight", "mlp_proj.weight"))
            tensor = tensor.t() if is_conv1d else tensor
            if tensor.shape != params[name].shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing GPT-2 weights: {sorted(missing)[:5]}")
