"""Paged KV cache bookkeeping: a free list of physical blocks and one block table per sequence.

No tensors here: the model runner owns the pool; this class only decides which block ids a
sequence holds. Reference counts make a block shareable (prefix caching) without a redesign.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_tables: dict[int, list[int]] = {}

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

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Extend the sequence's table to cover num_tokens tokens; a block only when the last is full."""
        missing = self.num_missing_blocks(seq_id, num_tokens)
        if missing > len(self._free_block_ids):
            raise RuntimeError(f"KV pool exhausted: need {missing} blocks, {self.num_free_blocks} free")
        table = self._block_tables.setdefault(seq_id, [])
        for _ in range(missing):
            block_id = self._free_block_ids.popleft()
            self._ref_counts[block_id] = 1
            table.append(block_id)

    def free(self, seq_id: int) -> None:
        for block_id in self._block_tables.pop(seq_id, ()):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)
