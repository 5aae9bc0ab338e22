"""How a model's attention layers share the KV pool: KV cache groups of equal size, one attention
kind (full, or one sliding window) per group, as vLLM's hybrid KV cache manager groups them.

A block id names one slot of the pool's K/V tensors; the j-th layer of every group writes tensor j.
So a block handed to a group holds that group's layers only, and a window group can give its old
blocks back while full-attention groups keep theirs (the block manager decides; this only says who
is in which group). A model without sliding layers is one group of all its layers, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember_core.layers.attention import PagedAttention
from ember_core.layers.kv_quant import cache_row


@dataclass(frozen=True)
class KVCacheLayout:
    group_windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layers_per_group: int
    # per attention layer, in model order: (group, index of the pool tensor it writes)
    placement: tuple[tuple[int, int], ...]
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty(0, dtype=dtype).element_size()
        return self.layers_per_group * 2 * block_size * self.num_kv_heads * cache_row(self.head_dim, dtype) * element_size


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    return [module for module in model.modules() if isinstance(module, PagedAttention)]


def kv_cache_layout(model: nn.Module) -> KVCacheLayout:
    """Layers of each window value in model order, cut into groups of as many layers as the rarest
    kind has (a kind whose count is not a multiple leaves its last group's extra tensors unused)."""
    layers = attention_layers(model)
    shapes = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
    if len(shapes) != 1:
        raise ValueError(f"the KV pool needs every attention layer to keep K/V of one shape, got {sorted(shapes)}")
    by_window: dict[int | None, list[int]] = {}
    for index, layer in enumerate(layers):
        by_window.setdefault(layer.sliding_window, []).append(index)
    size = min(len(indices) for indices in by_window.values())
    group_windows: list[int | None] = []
    placement: dict[int, tuple[int, int]] = {}
    for window, indices in by_window.items():
        for start in range(0, len(indices), size):
            for slot, index in enumerate(indices[start : start + size]):
                placement[index] = (len(group_windows), slot)
            group_windows.append(window)
    (num_kv_heads, head_dim), = shapes
    return KVCacheLayout(tuple(group_windows), size, tuple(placement[i] for i in range(len(layers))), num_kv_heads, head_dim)
