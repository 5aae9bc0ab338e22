"""What one engine's prefix cache holds, as its KvEvents tell: the set of block hashes, kept in
step with the engine's batch sequence numbers; and what it is about to hold: the blocks of prompts
routed there, so that requests sharing a prefix that arrive together (a tenant's users, a burst)
follow the first one before the engine has computed and reported it. Such a block counts as long
as the request routed with it is in flight, however long it queues: an overloaded engine reports
a prompt's blocks late, and losing track of them then would scatter the tenant."""

from __future__ import annotations

from collections.abc import Container

from ember_proto import KvEvents


class KvIndex:
    def __init__(self) -> None:
        self._hashes: set[bytes] = set()
        self._sequence: int | None = None  # of the last batch applied; None until a snapshot
        self._awaiting_snapshot = False
        self._expected: dict[bytes, str] = {}  # routed here, not reported yet -> the request routed with it

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

    def expect(self, request_id: str, block_hashes: list[bytes], in_flight: Container[str]) -> None:
        """A prompt with these blocks was just routed here as request_id; in_flight: the requests
        this engine runs for the gateway."""
        if len(self._expected) > len(self._hashes) + 4096:  # drop the finished requests', now and then
            self._expected = {h: request for h, request in self._expected.items() if request in in_flight}
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                self._expected[block_hash] = request_id

    def clear(self) -> None:
        """Forget the engine's cache (it was lost or restarted): the next snapshot refills it."""
        self._hashes.clear()
        self._expected.clear()
        self._sequence = None
        self._awaiting_snapshot = False

    def cached_prefix(self, block_hashes: list[bytes], in_flight: Container[str]) -> int:
        """How many leading blocks of a prompt the engine holds or is about to (a request in_flight
        was routed with them), as far as they run unbroken."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes and self._expected.get(block_hash) not in in_flight:
                break
            count += 1
        return count
