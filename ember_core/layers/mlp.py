"""The gated MLP of the Llama-like families (SwiGLU or GeGLU), gate and up as one fused Linear."""

from __future__ import annotations

import torch
from torch import nn

from ember_core.layers.activation import GATED_ACTIVATIONS


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_and_mul = GATED_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
