"""Weights a 16-bit checkpoint gives a float32 model: every value is a bfloat16 (or float16), so the
16-bit rows can be kept and widened inside the kernels, exactly, instead of float32 copies."""

from __future__ import annotations

import gguf
import torch
from torch import nn

from ember_core.layers.block_embedding import GGUFBlockEmbedding
from ember_core.layers.linear import (
    SIXTEEN_BIT_KINDS,
    SIXTEEN_BIT_ROW_MULTIPLE,
    GGUFBlockLinear,
    children_of_type,
    runs_on_cpu_kernels,
)


def _sixteen_bit_rows(weight: torch.Tensor) -> tuple[torch.Tensor, gguf.GGMLQuantizationType] | None:
    """(uint8 rows, kind) of a float32 weight that holds only bfloat16 (else float16) values; None otherwise."""
    if weight.shape[-1] % SIXTEEN_BIT_ROW_MULTIPLE:
        return None
    for dtype, kind in SIXTEEN_BIT_KINDS.items():
        rows = weight.detach().to(dtype)
        if torch.equal(rows.float(), weight):
            return rows.view(torch.uint8), kind
    return None


def keep_16_bit_weights(model: nn.Module) -> int:
    """Swap every `nn.Linear` and `nn.Embedding` of a float32 CPU model whose weight holds only
    bfloat16 (else float16) values, as a 16-bit checkpoint loaded in float32 does, for a
    `GGUFBlockLinear` / `GGUFBlockEmbedding` over those 16-bit rows: the same output bits for half
    the bytes (a tied head and its embedding share one copy). Returns how many were swapped."""
    if not runs_on_cpu_kernels(model):
        return 0
    rows_of: dict[int, tuple[torch.Tensor, gguf.GGMLQuantizationType] | None] = {}  # by id of the weight
    swapped = 0
    for parent, name, child in [*children_of_type(model, nn.Embedding), *children_of_type(model, nn.Linear)]:
        weight = child.weight
        if id(weight) not in rows_of:
            rows_of[id(weight)] = _sixteen_bit_rows(weight)
        if rows_of[id(weight)] is None:
            continue
        rows, kind = rows_of[id(weight)]
        if isinstance(child, nn.Embedding):
            setattr(parent, name, GGUFBlockEmbedding(rows, kind, child.embedding_dim))
        else:
            setattr(parent, name, GGUFBlockLinear(rows, kind, child.in_features, child.bias))
        swapped += 1
    return swapped
