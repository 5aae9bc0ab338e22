"""The one pool of physical KV blocks that every KV cache group draws from: a free list, reference
counts, and the prefix cache, in which each group keeps its own blocks.

A full, computed block is registered under a hash of its tokens and of every token before it. A
freed block keeps its contents and its hash until the free list hands it out again (least recently
freed first), so a later sequence with the same prefix takes the block, shared through its
reference count, instead of computing it again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CacheEvents:
    """Prefix hashes registered in and evicted from the cache since the last take_events()."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int, reported_group: int) -> None:
        self.num_blocks = num_blocks
        # Blocks no sequence holds, least recently freed first; O(1) removal of a cache hit.
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._cached_blocks: list[dict[bytes, int]] = [{} for _ in range(num_groups)]  # per group: hash -> block
        self._block_hashes: dict[int, tuple[int, bytes]] = {}  # block -> (group, hash), for eviction
        # The group whose prefix hashes the events and cached_hashes() describe.
        self._reported_group = reported_group
        self._events: CacheEvents | None = None  # recorded once someone takes them

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def take(self) -> int:
        """A block off the free list, its cached contents forgotten."""
        block_id, _ = self._free_block_ids.popitem(last=False)
        self._evict(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def hold(self, block_id: int) -> None:
        """One more holder of a block (a cache hit): off the free list if nobody held it."""
        if self._ref_counts[block_id] == 0:
            del self._free_block_ids[block_id]
        self._ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        """One holder less; the last one returns the block to the free list, still cached."""
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free_block_ids[block_id] = None

    def cached_block(self, group: int, block_hash: bytes) -> int | None:
        return self._cached_blocks[group].get(block_hash)

    def register(self, group: int, block_hash: bytes, block_id: int) -> None:
        """Cache a group's computed full block; a prefix cached already keeps its block."""
        cached = self._cached_blocks[group]
        if block_hash in cached or block_id in self._block_hashes:
            return
        cached[block_hash] = block_id
        self._block_hashes[block_id] = (group, block_hash)
        if self._events is not None and group == self._reported_group:
            self._events.stored.append(block_hash)

    def reset(self) -> None:
        """Forget every registered block; holders keep their blocks."""
        if self._events is not None:
            self._events.removed.extend(self._cached_blocks[self._reported_group])
        for cached in self._cached_blocks:
            cached.clear()
        self._block_hashes.clear()

    def _evict(self, block_id: int) -> None:
        entry = self._block_hashes.pop(block_id, None)
        if entry is None:
            return
        group, block_hash = entry
        del self._cached_blocks[group][block_hash]
        if self._events is not None and group == self._reported_group:
            self._events.removed.append(block_hash)

    def take_events(self) -> CacheEvents:
        events, self._events = self._events or CacheEvents(), CacheEvents()
        return events

    def cached_hashes(self) -> list[bytes]:
        return list(self._cached_blocks[self._reported_group])

    def cached_block_ids(self) -> list[int]:
        """Every block registered in the prefix cache, of any group, held or not."""
        return list(self._block_hashes)
