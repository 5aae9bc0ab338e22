"""A hybrid model's state pool, beside the KV pool: for every recurrent layer, each slot's
convolution state (in the model's dtype) and recurrent state (float32, as the recurrence runs).
A running sequence holds one slot (engine/state_slots.py) however long its context grows; the
slots after the running sequences' hold prefix checkpoints (engine/state_checkpoints.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ember_core.layers.gated_delta_net import GatedDeltaNet


def recurrent_layers(model: nn.Module) -> list[GatedDeltaNet]:
    return [module for module in model.modules() if isinstance(module, GatedDeltaNet)]


def state_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """What one slot costs across the model's recurrent layers; 0 for a model without any."""
    element = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for layer in recurrent_layers(model):
        conv, recurrent = layer.state_shapes()
        total += math.prod(conv) * element + math.prod(recurrent) * 4
    return total


def bind_state_pool(model: nn.Module, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
    """Give every recurrent layer its states for num_slots slots, zeroed."""
    for layer in recurrent_layers(model):
        conv, recurrent = layer.state_shapes()
        layer.conv_state = torch.zeros((num_slots, *conv), dtype=dtype, device=device)
        layer.recurrent_state = torch.zeros((num_slots, *recurrent), dtype=torch.float32, device=device)


def copy_state_slots(layers: list[GatedDeltaNet], copies: list[tuple[int, int]]) -> None:
    """Copy every layer's states from one slot to another, for each (from, to) in order."""
    for source, target in copies:
        for layer in layers:
            assert layer.conv_state is not None and layer.recurrent_state is not None
            layer.conv_state[target].copy_(layer.conv_state[source])
            layer.recurrent_state[target].copy_(layer.recurrent_state[source])
