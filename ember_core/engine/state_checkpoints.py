"""A hybrid model's prefix cache for its recurrent state: copies of a sequence's states taken at
block boundaries, keyed by the prefix hash of the block that ends there (cache/block_hash.py), in
slots of the state pool beside the running sequences'.

Attention layers resume from cached KV blocks at any block; a recurrent layer's state sums the
whole prefix, so a prefix is reusable only up to a boundary where its state was checkpointed. The
scheduler checkpoints a sequence at each block-aligned end of its prompt chunks (it aligns them) and,
while it decodes, at its latest boundary (the one before replaced), so a conversation's next turn
resumes where the previous answer's last full block ends. A hit copies the checkpoint into the
sequence's own slot: the state is the same bits recomputing would give (the recurrence runs token
by token). Checkpoints are evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    def __init__(self, first_slot: int, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> slot, least recently used first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def take(self, block_hash: bytes) -> int:
        """The slot of a checkpoint about to be restored (it becomes the most recently used)."""
        self._slots.move_to_end(block_hash)
        return self._slots[block_hash]

    def store(self, block_hash: bytes) -> int | None:
        """A slot to copy a checkpoint for block_hash into, evicting the least recently used one
        when all are held; None when it is stored already (the same prefix gives the same state)."""
        if block_hash in self._slots or not (self._free or self._slots):
            return None
        slot = self._free.pop() if self._free else self._slots.popitem(last=False)[1]
        self._slots[block_hash] = slot
        return slot

    def drop(self, block_hash: bytes) -> None:
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
