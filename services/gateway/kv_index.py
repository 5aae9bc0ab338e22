"""What one engine's prefix cache holds, as its KvEvents tell: the set of block hashes, kept in
step with the engine's batch sequence numbers; and what it is about to hold: the blocks of prompts
just routed there, so that requests sharing a prefix that arrive together (a tenant's users, a
burst) follow the first one before the engine has computed and reported it."""

from __future__ import annotations

import time

from ember_proto import KvEvents

# How long a routed prompt's blocks count as the engine's without its events confirming them: a
# prompt is admitted and computed within this on a healthy engine, or its blocks were evicted.
EXPECTED_BLOCKS_TTL_S = 30.0


class KvIndex:
    def __init__(self) -> None:
        self._hashes: set[bytes] = set()
        self._sequence: int | None = None  # of the last batch applied; None until a snapshot
        self._awaiting_snapshot = False
        self._expected: dict[bytes, float] = {}  # routed here, not reported yet -> when that stops counting

    def __len__(self) -> int:
        return len(self._hashes)

    def apply(self, events: KvEvents) -> bool:
        """Apply a batch or a snapshot. True when a batch went missing before this one: the caller
        asks for a snapshot (once; later batches wait for it), and the index stays as it was."""
        if events.snapshot:
            self._hashes = set(events.stored)
            self._sequence = events.sequence
            self._awaiting_snapshot = False
            return False
        if self._sequence is not None and events.sequence <= self._sequence:
            return False  # already in the snapshot
        if self._sequence is None or events.sequence != self._sequence + 1:
            ask, self._awaiting_snapshot = not self._awaiting_snapshot, True
            return ask
        self._hashes.difference_update(events.removed)
        self._hashes.update(events.stored)
        for block_hash in events.stored:
            self._expected.pop(block_hash, None)
        self._sequence = events.sequence
        return False

    def expect(self, block_hashes: list[bytes]) -> None:
        """A prompt with these blocks was just routed here."""
        now = time.monotonic()
        if len(self._expected) > len(self._hashes) + 4096:  # drop what expired, now and then
            self._expected = {h: until for h, until in self._expected.items() if until > now}
        until = now + EXPECTED_BLOCKS_TTL_S
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                self._expected[block_hash] = until

    def clear(self) -> None:
        """Forget the engine's cache (it was lost or restarted): the next snapshot refills it."""
        self._hashes.clear()
        self._expected.clear()
        self._sequence = None
        self._awaiting_snapshot = False

    def cached_prefix(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt the engine holds or is about to, as far as they run
        unbroken."""
        now = time.monotonic()
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes and self._expected.get(block_hash, 0.0) <= now:
                break
            count += 1
        return count
