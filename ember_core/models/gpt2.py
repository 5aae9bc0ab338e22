"""GPT-2 from scratch: learned positions, pre-LayerNorm blocks, GELU MLP, LM head tied to the embedding
(or its own `lm_head.weight` with `tie_word_embeddings: false`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ember_core.layers.attention import AttentionMetadata, PagedAttention
from ember_core.layers.linear import tied_head
from ember_core.layers.lora import AdapterTarget
from ember_core.models.gpt2_config import ACTIVATIONS, GPT2Config
from ember_core.parallel.gpt2_shards import GPT2Shards
from ember_core.parallel.group import TensorParallel


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int, shards: GPT2Shards | None = None) -> None:
        """shards: this block is one tensor-parallel rank's part (its heads and MLP rows), whose
        attention and MLP outputs are partial sums, added across ranks before the residual."""
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_heads if shards is None else shards.local_heads
        intermediate = config.intermediate_size if shards is None else shards.local_intermediate_size
        scale = config.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.parallel = None if shards is None else shards.parallel
        self.ln_1 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.c_attn = nn.Linear(hidden, 3 * heads * config.head_dim)
        self.attn = PagedAttention(heads, heads, config.head_dim, scale)
        self.attn_proj = nn.Linear(heads * config.head_dim, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.c_fc = nn.Linear(hidden, intermediate)
        self.mlp_proj = nn.Linear(intermediate, hidden)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(hidden)).chunk(3, dim=-1)
        hidden = hidden + self._summed(self.attn_proj(self.attn(q, k, v, meta)))
        return hidden + self._summed(self.mlp_proj(self.act(self.c_fc(self.ln_2(hidden)))))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.parallel is None else self.parallel.sum(partial)


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config, parallel: TensorParallel | None = None) -> None:
        """parallel: this model is one tensor-parallel rank's part of it (parallel/gpt2_shards.py)."""
        super().__init__()
        self.config = config
        self.shards = None if parallel is None else GPT2Shards(config, parallel)
        vocab = config.vocab_size if self.shards is None else self.shards.vocab.local_size
        self.wte = nn.Embedding(vocab, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(GPT2Block(config, i, self.shards) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = tied_head(self.wte)
        else:
            self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = self.wte(input_ids) if self.shards is None else self.shards.vocab.embedded(self.wte, input_ids)
        hidden = tokens + self.wpe(positions)
        for block in self.blocks:
            hidden = block(hidden, meta)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.shards is None else self.shards.vocab.logits(logits)

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
