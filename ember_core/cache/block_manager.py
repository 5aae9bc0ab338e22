"""Paged KV cache bookkeeping: which physical blocks each sequence holds, one block table per KV
cache group, all drawn from one BlockPool (free list, reference counts, prefix cache).

The runner splits a model's layers into groups of equal size, one attention kind per group (full
attention, or one sliding window W: a token at p attends to p - W < q <= p). A block handed to a
group addresses that group's layers only, until the group releases it. A full-attention group
keeps every block of a sequence; a window group drops the blocks no token left to compute attends
to, so in steady decoding it holds at most ceil(W / block_size) + 1 of them. A model without
sliding layers has one full group. No tensors here: the runner owns the KV pool.

Tables are indexed by position: entry i covers positions [i * block_size, (i + 1) * block_size),
and every group's table of a sequence has the same length. The entries a window group dropped hold
DROPPED_BLOCK; the runner never reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from ember_core.cache.block_pool import BlockPool, CacheEvents
from ember_core.cache.cache_hit import longest_cache_hit
from ember_core.cache.window import first_needed_block, window_peak_blocks

DROPPED_BLOCK = -1


@dataclass
class _HeldBlocks:
    """One sequence's blocks."""

    tables: list[list[int]]  # per group, position-indexed
    first_held: list[int]  # per group: the entries before it are DROPPED_BLOCK
    num_offered: int = 0  # leading entries already offered to the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, group_windows: Sequence_[int | None] = (None,)) -> None:
        """group_windows[g]: None for a full-attention group, else its sliding window in positions."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if not group_windows:
            raise ValueError("group_windows names no KV cache group")
        for window in group_windows:
            if window is not None and (not isinstance(window, int) or window < 1):
                raise ValueError(f"a sliding window must be an int >= 1 or None (full attention), got {window!r}")
        self.block_size = block_size
        self.group_windows: tuple[int | None, ...] = tuple(group_windows)
        # Events and cached_hashes() report the first full-attention group, or group 0 if every group slides.
        reported = next((g for g, window in enumerate(self.group_windows) if window is None), 0)
        self._pool = BlockPool(num_blocks, len(self.group_windows), reported)
        self._held: dict[int, _HeldBlocks] = {}

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._pool.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for_sequence(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a lone sequence of num_tokens tokens holds at once, its prompt computed
        in chunks of at most chunk_tokens tokens."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        total = self.blocks_for_tokens(num_tokens)
        return sum(self._peak_blocks(window, total, chunk_tokens) for window in self.group_windows)

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's table in each group (the manager's own lists: read, never modify)."""
        held = self._held.get(seq_id)
        return held.tables if held else [[] for _ in self.group_windows]

    def block_table(self, seq_id: int) -> list[int]:
        """Group 0's table: the whole table of a model with one group."""
        return self.block_tables(seq_id)[0]

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref_count(block_id)

    def num_missing_blocks(self, seq_id: int, num_tokens: int, num_computed: int = 0) -> int:
        """Blocks the free list must still give so that the sequence's tables cover num_tokens tokens,
        net of those that dropping the blocks before num_computed's window returns to it."""
        held = self._held.get(seq_id)
        length = len(held.tables[0]) if held else 0
        if not 0 <= num_computed <= min(num_tokens, length * self.block_size):
            raise ValueError(
                f"num_computed {num_computed} is outside [0, min(num_tokens {num_tokens}, "
                f"the {length * self.block_size} positions the tables cover)]"
            )
        new = max(0, self.blocks_for_tokens(num_tokens) - length) * self.num_groups
        returned = 0
        if held:
            returned = sum(
                1 for group, indices in self._droppable(held, num_computed) for index in indices
                if self._pool.ref_count(held.tables[group][index]) == 1
            )
        return max(0, new - returned)

    def can_grow(self, seq_id: int, num_tokens: int, num_computed: int = 0) -> bool:
        return self.num_missing_blocks(seq_id, num_tokens, num_computed) <= self._pool.num_free_blocks

    def grow(self, seq_id: int, num_tokens: int, num_computed: int = 0) -> None:
        """Before a step computes tokens [num_computed, num_tokens): drop the window groups' blocks
        no token from num_computed on attends to, then extend every table to cover num_tokens
        tokens (a block only when the last is full). num_computed 0 drops nothing."""
        missing = self.num_missing_blocks(seq_id, num_tokens, num_computed)
        if missing > self._pool.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: need {missing} blocks, {self.num_free_blocks} free")
        held = self._held.setdefault(
            seq_id, _HeldBlocks([[] for _ in self.group_windows], [0] * self.num_groups)
        )
        self._drop(held, num_computed)
        num_blocks = self.blocks_for_tokens(num_tokens)
        for table in held.tables:
            while len(table) < num_blocks:
                table.append(self._pool.take())

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Release the sequence's blocks past those covering num_tokens tokens (the positions of a
        step's rejected draft tokens): last first, as free() does."""
        held = self._held[seq_id]
        keep = self.blocks_for_tokens(num_tokens)
        for index in reversed(range(keep, len(held.tables[0]))):
            for table in held.tables:
                if table[index] != DROPPED_BLOCK:
                    self._pool.release(table[index])
        for table in held.tables:
            del table[keep:]

    def free(self, seq_id: int) -> None:
        held = self._held.pop(seq_id, None)
        if held is None:
            return
        # Last position first, in every group: a prefix's first blocks, shared most widely, stay
        # cached the longest.
        for index in reversed(range(len(held.tables[0]))):
            for table in held.tables:
                if table[index] != DROPPED_BLOCK:
                    self._pool.release(table[index])

    def cached_prefix(
        self, block_hashes: list[bytes], completed_in_step: Sequence_[Mapping[bytes, int]] = ()
    ) -> list[list[int]]:
        """Per group, the table of the longest prefix of these hashes a sequence may start from:
        every full group holds all its blocks, every window group the blocks in the window of the
        first position after it (the entries before that are DROPPED_BLOCK). completed_in_step:
        per group, prefix hash -> block of the blocks that sequences scheduled earlier in this step
        complete; they count as cached, since every step writes its K/V before any attention reads."""

        def block_of(group: int, index: int) -> int | None:
            block_hash = block_hashes[index]
            block_id = self._pool.cached_block(group, block_hash)
            if block_id is None and completed_in_step:
                block_id = completed_in_step[group].get(block_hash)
            return block_id

        hit = longest_cache_hit(
            len(block_hashes), self.group_windows, self.block_size, lambda g, i: block_of(g, i) is not None
        )
        tables = []
        for group, window in enumerate(self.group_windows):
            first = 0 if window is None else first_needed_block(hit * self.block_size, window, self.block_size)
            tables.append([DROPPED_BLOCK] * first + [block_of(group, index) for index in range(first, hit)])
        return tables

    def largest_fitting_chunk(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The largest chunk size <= max_chunk_tokens with which a lone sequence of num_tokens tokens
        fits the pool (smaller chunks lower what a window group holds at once); 0 if none does."""
        return _largest(max_chunk_tokens, lambda chunk: self.blocks_for_sequence(num_tokens, chunk) <= self.num_blocks)

    def longest_fitting_sequence(self, max_tokens: int, chunk_tokens: int) -> int:
        """The most tokens, up to max_tokens, one sequence can reach in the whole pool (window groups
        hold only their windows: a model with windows fits more than the pool's token count)."""
        return _largest(max_tokens, lambda tokens: self.blocks_for_sequence(tokens, chunk_tokens) <= self.num_blocks)

    def can_start(self, num_tokens: int, cached: Sequence_[list[int]] = (), *, chunk_tokens: int) -> bool:
        """Whether a sequence holding no blocks can take these cached tables (cached_prefix's, or none)
        and compute up to num_tokens tokens, in chunks of at most chunk_tokens, in the blocks free now."""
        total = self.blocks_for_tokens(num_tokens)
        needed = 0
        for window, table in zip(self.group_windows, cached or [[]] * self.num_groups):
            # Cached blocks nobody holds leave the free list too.
            revived = sum(1 for b in table if b != DROPPED_BLOCK and self._pool.ref_count(b) == 0)
            needed += min(revived + total - len(table), self._peak_blocks(window, total, chunk_tokens))
        return needed <= self._pool.num_free_blocks

    def share(self, seq_id: int, cached: Sequence_[list[int]]) -> None:
        """Start the tables of a sequence that holds no blocks with these cached tables (cached_prefix's)."""
        if len(cached) != self.num_groups:
            raise ValueError(f"{len(cached)} cached tables for {self.num_groups} KV cache groups")
        if self.block_table(seq_id):
            raise RuntimeError(f"sequence {seq_id} already holds blocks")
        tables = [list(table) for table in cached]
        for table in tables:
            for block_id in table:
                if block_id != DROPPED_BLOCK:
                    self._pool.hold(block_id)
        first_held = [next((i for i, b in enumerate(table) if b != DROPPED_BLOCK), len(table)) for table in tables]
        self._held[seq_id] = _HeldBlocks(tables, first_held, num_offered=len(tables[0]))

    def offer_full_blocks(self, seq_id: int, block_hashes: list[bytes], num_full_blocks: int) -> None:
        """Register the sequence's computed full blocks that each group still holds (its tables'
        first num_full_blocks, whose prefix hashes lead block_hashes) in that group's cache; a
        prefix cached already keeps its block."""
        held = self._held[seq_id]
        for index in range(held.num_offered, num_full_blocks):
            for group, table in enumerate(held.tables):
                if table[index] != DROPPED_BLOCK:
                    self._pool.register(group, block_hashes[index], table[index])
        held.num_offered = max(num_full_blocks, held.num_offered)

    def reset_prefix_cache(self) -> None:
        """Forget every registered block; sequences keep the blocks they hold."""
        self._pool.reset()

    def take_events(self) -> CacheEvents:
        """What the cache registered and evicted since the last call (for the gateways' routing);
        recording starts with the first call, which returns nothing. The events describe one group:
        the first full-attention group, or group 0 when every group slides."""
        return self._pool.take_events()

    def cached_hashes(self) -> list[bytes]:
        """Every prefix hash the cache holds now, in the group take_events() describes."""
        return self._pool.cached_hashes()

    def cached_block_ids(self) -> list[int]:
        """Every block the prefix cache holds, in any group, whether a sequence holds it or not."""
        return self._pool.cached_block_ids()

    def _peak_blocks(self, window: int | None, total: int, chunk_tokens: int) -> int:
        """The most of a sequence's `total` blocks a group holds at once."""
        if window is None:
            return total
        return min(total, window_peak_blocks(window, chunk_tokens, self.block_size))

    def _droppable(self, held: _HeldBlocks, num_computed: int) -> Iterator[tuple[int, range]]:
        """Per window group, the indices of the blocks it holds that no token from num_computed on
        attends to; amortised O(1) a block, as each group resumes at its first held entry."""
        for group, window in enumerate(self.group_windows):
            if window is not None:
                yield group, range(held.first_held[group], first_needed_block(num_computed, window, self.block_size))

    def _drop(self, held: _HeldBlocks, num_computed: int) -> None:
        for group, indices in self._droppable(held, num_computed):
            table = held.tables[group]
            for index in reversed(indices):  # last first, as free() does
                self._pool.release(table[index])
                table[index] = DROPPED_BLOCK
            held.first_held[group] = max(held.first_held[group], indices.stop)


def _largest(high: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [0, high] for which fits(n) holds, fits being true up to some n and false
    beyond (fits(0) is taken as true and never asked)."""
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
