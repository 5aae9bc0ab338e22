"""Stop strings matched across token boundaries, holding back only text that could still start one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    text: str  # safe to send: can no longer be part of a stop string
    stopped: bool  # a stop string completed; text ends right before it (or with it, if included)


class StopStringMatcher:
    """Feed text as it is detokenized; get back what may be sent now.

    When several stop strings occur, the one that completes first wins (ties: the one that starts
    first), so the result does not depend on how the text was split into pushes.
    """

    def __init__(self, stop_strings: Sequence[str], include_stop: bool = False) -> None:
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stop_strings = tuple(stop_strings)
        self._include_stop = include_stop
        self._longest = max(map(len, stop_strings), default=0)
        self._pending = ""

    def push(self, text: str) -> StopMatch:
        if not self._stop_strings:
            return StopMatch(text, False)
        pending = self._pending + text
        match = self._first_completed_match(pending)
        if match is not None:
            self._pending = ""
            end, start = match
            return StopMatch(pending[: end if self._include_stop else start], True)
        held = self._longest_partial_suffix(pending)
        self._pending = pending[len(pending) - held :]
        return StopMatch(pending[: len(pending) - held], False)

    def flush(self) -> str:
        """The held-back text, once no more text will come."""
        text, self._pending = self._pending, ""
        return text

    def _first_completed_match(self, text: str) -> tuple[int, int] | None:
        """(end, start) of the match that completes first."""
        best: tuple[int, int] | None = None
        for stop in self._stop_strings:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return best

    def _longest_partial_suffix(self, text: str) -> int:
        for length in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[len(text) - length :]
            if any(stop.startswith(suffix) for stop in self._stop_strings):
                return length
        return 0
