"""An embedding request's pooling, chunk by chunk: which rows of a chunk it sums, and the embedding
the sums make once its whole prompt is computed."""

from __future__ import annotations

import torch

from ember_core.engine.sequence import Sequence
from ember_core.pooling import PoolingConfig


def pooled_rows(seq: Sequence, start: int, num_tokens: int) -> tuple[int, int] | None:
    """[first, end) rows of a chunk of num_tokens at position start that seq pools; None: none."""
    if seq.pooling == "mean":
        return 0, num_tokens
    if seq.pooling == "cls":
        return (0, 1) if start == 0 else None
    if seq.pooling == "last" and start + num_tokens == seq.num_prompt_tokens:
        return num_tokens - 1, num_tokens
    return None


def add_pooled(seq: Sequence, start: int, pooled: torch.Tensor | None) -> None:
    """Add a chunk's pooled sum; a chunk at position 0 starts over (a preempted request recomputes)."""
    if pooled is not None:
        seq.pooled = pooled if seq.pooled is None or start == 0 else seq.pooled + pooled


def embedding_bytes(seq: Sequence, config: PoolingConfig) -> bytes:
    """The embedding as the wire carries it (RequestDelta.embedding): float32, little-endian;
    truncated to the request's dimensions first, then L2-normalised where the model normalises."""
    vector = seq.pooled / seq.num_prompt_tokens if seq.pooling == "mean" else seq.pooled
    if seq.embed_dimensions is not None:
        vector = vector[: seq.embed_dimensions]
    if config.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    wire: bytes = vector.to(device="cpu", dtype=torch.float32).numpy().astype("<f4").tobytes()
    return wire
