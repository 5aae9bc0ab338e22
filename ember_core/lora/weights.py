"""An adapter's weights as ember serves them, whichever file they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdapterWeights:
    rank: int
    scale: float  # alpha / rank (alpha / sqrt(rank) with rsLoRA): one for every module
    # the base model's module name, as transformers names it ("model.layers.0.self_attn.q_proj") ->
    # (A [rank, in], B [out, rank]), B's rows in that module's order
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
