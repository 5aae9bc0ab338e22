"""Block arithmetic of a sliding-window attention layer: a token at position p attends to the
positions q with p - window < q <= p, so it needs no block that ends before p - window + 1."""

from __future__ import annotations


def first_needed_block(num_computed: int, window: int, block_size: int) -> int:
    """The first block any token from position num_computed on still attends to; those before it
    are never read again."""
    return max(0, num_computed - window + 1) // block_size


def window_peak_blocks(window: int, chunk_tokens: int, block_size: int) -> int:
    """The most blocks one sequence holds at once in a window group when it computes at most
    chunk_tokens tokens a step: the window before the chunk's first token and the chunk itself,
    plus one block that the window's start may cut."""
    return -(-(window - 1 + chunk_tokens) // block_size) + 1
