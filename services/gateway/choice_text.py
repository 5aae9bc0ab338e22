"""One choice's tokens turned into text: incremental detokenization, then stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from ember_core.tokenizer import IncrementalDetokenizer, Tokenizer
from ember_gateway.stop_strings import StopMatch, StopStringMatcher


class ChoiceText:
    def __init__(self, tokenizer: Tokenizer | None, stop_strings: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stops = StopStringMatcher(stop_strings)

    def push(self, token_ids: Sequence[int], final: bool) -> StopMatch:
        """The text these tokens add that is safe to send. final: no tokens follow, so nothing
        stays held back."""
        if self._detokenizer is None:
            return StopMatch("", False)
        text = self._detokenize(token_ids)
        if final:
            text += self._detokenizer.flush()
        match = self._stops.push(text)
        if final and not match.stopped:
            return StopMatch(match.text + self._stops.flush(), False)
        return match

    def _detokenize(self, token_ids: Sequence[int]) -> str:
        assert self._detokenizer is not None and self._tokenizer is not None
        try:
            return self._detokenizer.push(token_ids)
        except ValueError:
            # Models often pad their vocabulary past the tokenizer's; such ids carry no text.
            return self._detokenizer.push([token_id for token_id in token_ids if self._has_text(token_id)])

    def _has_text(self, token_id: int) -> bool:
        assert self._tokenizer is not None
        try:
            self._tokenizer.decode_bytes([token_id])
        except ValueError:
            return False
        return True
