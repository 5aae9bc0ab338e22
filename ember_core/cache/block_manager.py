"""Paged KV cache bookkeeping: a free list of physical blocks, one block table per sequence, and
the prefix cache.

No tensors here: the model runner owns the pool; this class only decides which block ids a
sequence holds. Prefix caching: a full, computed block is registered under a hash of its tokens
and of every token before it. A freed block keeps its contents and its hash until the free list
hands it out again (least recently freed first), so a later sequence with the same prefix takes
the block, shared through its reference count, instead of computing it again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CacheEvents:
    """Prefix hashes registered in and evicted from the cache since the last take_events()."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Blocks no sequence holds, least recently freed first; O(1) removal of a cache hit.
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_tables: dict[int, list[int]] = {}
        self._cached_blocks: dict[bytes, int] = {}  # prefix hash -> the block holding it
        self._block_hashes: dict[int, bytes] = {}  # the reverse, for eviction
        self._num_offered: dict[int, int] = {}  # seq id -> blocks of its table already offered to the cache
        self._events: CacheEvents | None = None  # recorded once someone takes them

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._block_tables.get(seq_id, [])

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_missing_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks a sequence must still get so that its table covers num_tokens tokens."""
        held = len(self._block_tables.get(seq_id, ()))
        return max(0, self.blocks_for_tokens(num_tokens) - held)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq_id, num_tokens) <= len(self._free_block_ids)

    def can_start(self, num_tokens: int, cached: list[int]) -> bool:
        """Whether a sequence holding no blocks can take these cached blocks and grow to num_tokens."""
        revived = sum(1 for block_id in cached if self._ref_counts[block_id] == 0)  # they leave the free list
        return self.blocks_for_tokens(num_tokens) - len(cached) + revived <= len(self._free_block_ids)

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Extend the sequence's table to cover num_tokens tokens; a block only when the last is full."""
        missing = self.num_missing_blocks(seq_id, num_tokens)
        if missing > len(self._free_block_ids):
            raise RuntimeError(f"KV pool exhausted: need {missing} blocks, {self.num_free_blocks} free")
        table = self._block_tables.setdefault(seq_id, [])
        for _ in range(missing):
            block_id, _ = self._free_block_ids.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            table.append(block_id)

    def free(self, seq_id: int) -> None:
        # Last block first: a prefix's first blocks, shared most widely, stay cached the longest.
        for block_id in reversed(self._block_tables.pop(seq_id, ())):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_block_ids[block_id] = None
        self._num_offered.pop(seq_id, None)

    def cached_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks holding the leading blocks of these hashes, as far as they run unbroken."""
        hits = []
        for block_hash in block_hashes:
            block_id = self._cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def share(self, seq_id: int, cached: list[int]) -> None:
        """Start the table of a sequence that holds no blocks with these cached blocks."""
        if self._block_tables.get(seq_id):
            raise RuntimeError(f"sequence {seq_id} already holds blocks")
        for block_id in cached:
            if self._ref_counts[block_id] == 0:
                del self._free_block_ids[block_id]
            self._ref_counts[block_id] += 1
        self._block_tables[seq_id] = list(cached)
        self._num_offered[seq_id] = len(cached)

    def offer_full_blocks(self, seq_id: int, block_hashes: list[bytes], num_full_blocks: int) -> None:
        """Register the sequence's computed full blocks (its table's first num_full_blocks, whose
        prefix hashes lead block_hashes) in the cache; a prefix cached already keeps its block."""
        table = self._block_tables[seq_id]
        for index in range(self._num_offered.get(seq_id, 0), num_full_blocks):
            block_id, block_hash = table[index], block_hashes[index]
            if block_hash not in self._cached_blocks and block_id not in self._block_hashes:
                self._cached_blocks[block_hash] = block_id
                self._block_hashes[block_id] = block_hash
                if self._events is not None:
                    self._events.stored.append(block_hash)
        self._num_offered[seq_id] = max(num_full_blocks, self._num_offered.get(seq_id, 0))

    def reset_prefix_cache(self) -> None:
        """Forget every registered block; sequences keep the blocks they hold."""
        if self._events is not None:
            self._events.removed.extend(self._cached_blocks)
        self._cached_blocks.clear()
        self._block_hashes.clear()

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hashes.pop(block_id, None)
        if block_hash is not None:
            del self._cached_blocks[block_hash]
            if self._events is not None:
                self._events.removed.append(block_hash)

    def take_events(self) -> CacheEvents:
        """What the cache registered and evicted since the last call (for the gateways' routing);
        recording starts with the first call, which returns nothing."""
        events, self._events = self._events or CacheEvents(), CacheEvents()
        return events

    def cached_hashes(self) -> list[bytes]:
        """Every prefix hash the cache holds now."""
        return list(self._cached_blocks)
