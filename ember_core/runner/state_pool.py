"""A hybrid model's state pool, beside the KV pool: for every recurrent layer, each slot's states
(a convolution's last inputs in the model's dtype; a recurrence's state in float32, as it runs).
A running sequence holds one slot (engine/state_slots.py) however long its context grows; the
slots after the running sequences' hold prefix checkpoints (engine/state_checkpoints.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ember_core.layers.recurrent_layer import RecurrentLayer


def recurrent_layers(model: nn.Module) -> list[RecurrentLayer]:
    return [module for module in model.modules() if isinstance(module, RecurrentLayer)]


def state_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """What one slot costs across the model's recurrent layers; 0 for a model without any."""
    element = torch.empty(0, dtype=dtype).element_size()
    return sum(
        math.prod(shape) * (4 if float32 else element) for layer in recurrent_layers(model) for shape, float32 in layer.state_specs()
    )


def bind_state_pool(model: nn.Module, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
    """Give every recurrent layer its states for num_slots slots, zeroed."""
    for layer in recurrent_layers(model):
        layer.states = [
            torch.zeros((num_slots, *shape), dtype=torch.float32 if float32 else dtype, device=device)
            for shape, float32 in layer.state_specs()
        ]


def copy_state_slots(layers: list[RecurrentLayer], copies: list[tuple[int, int]]) -> None:
    """Copy every layer's states from one slot to another, for each (from, to) in order."""
    for source, target in copies:
        for layer in layers:
            for state in layer.states:
                state[target].copy_(state[source])
