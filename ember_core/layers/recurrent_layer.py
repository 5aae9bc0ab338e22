"""What a hybrid model's recurrent layers share: instead of KV blocks, each keeps a fixed-size state
per sequence in the runner's state pool (runner/state_pool.py), one slot per running sequence."""

from __future__ import annotations

import torch
from torch import nn

from ember_core.layers.recurrent_batch import RecurrentBatch


class RecurrentLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Set by the runner: per state_specs() entry, a [slots, *shape] tensor.
        self.states: list[torch.Tensor] = []

    def state_specs(self) -> list[tuple[tuple[int, ...], bool]]:
        """One slot's states: (shape, whether it is float32; else the model's dtype)."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        raise NotImplementedError


class MixerNormWeight(nn.Module):
    """Holds a mixer's gated RMSNorm weight (its arithmetic runs inside the mixer's op), named `norm`
    as checkpoints name it."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
