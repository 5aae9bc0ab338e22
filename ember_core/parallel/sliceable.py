"""What a tensor-parallel rank takes its part of a checkpoint tensor from."""

from __future__ import annotations

from typing import Any

# Any object indexed like a tensor that knows its shape: a tensor, a safetensors slice (which reads
# only the part indexed), or a GGUF tensor's blocks (loaders/gguf_blocks.BlockRows).
Sliceable = Any


def shape_of(source: Sliceable) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
