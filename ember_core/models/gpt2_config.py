"""GPT-2's sizes and switches, from its config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

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
