"""The longest cached prefix a sequence may start from when its layers attend over different spans."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ember_core.cache.window import first_needed_block

IsCached = Callable[[int, int], bool]  # (group, block index) -> whether the group holds that prefix block


def longest_cache_hit(
    num_blocks: int, group_windows: Sequence[int | None], block_size: int, is_cached: IsCached
) -> int:
    """The most leading blocks k <= num_blocks a sequence may take from the cache: every full-attention
    group holds blocks 0 .. k - 1, and every window group holds the blocks that the first token left
    to compute, at position k * block_size, attends to."""
    hit = num_blocks
    for group, window in enumerate(group_windows):
        if window is None:
            hit = next((index for index in range(hit) if not is_cached(group, index)), hit)
    # Window hits are not closed downward (a shorter prefix needs other blocks), so lowering the hit
    # for one group may break it for another: repeat until one pass lowers nothing. Full-attention
    # hits stay valid at any lower k.
    while True:
        lowered = hit
        for group, window in enumerate(group_windows):
            if window is not None:
                lowered = _longest_window_hit(group, window, lowered, block_size, is_cached)
        if lowered == hit:
            return hit
        hit = lowered


def _longest_window_hit(group: int, window: int, hit: int, block_size: int, is_cached: IsCached) -> int:
    """The longest hit <= hit of one window group, scanning its blocks right to left once: a missing
    block lies in the window of every longer hit, so the next candidate ends right before it."""
    index = hit - 1
    while hit > 0:
        first = first_needed_block(hit * block_size, window, block_size)
        while index >= first and is_cached(group, index):
            index -= 1
        if index < first:
            return hit
        hit = index
        index = hit - 1
    return 0
