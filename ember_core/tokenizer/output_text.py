"""One output's tokens turned into text: incremental detokenization, then stop strings, by vLLM's rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ember_core.tokenizer.detokenizer import IncrementalDetokenizer
from ember_core.tokenizer.stop_strings import StopMatch, StopStringMatcher
from ember_core.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class StopRules:
    strings: tuple[str, ...] = ()
    min_tokens: int = 0  # a stop string ends the output only from this many tokens on
    include_in_output: bool = False  # keep the stop string, or the text of the stop token that ended it


class OutputText:
    def __init__(
        self, tokenizer: Tokenizer | None, rules: StopRules = StopRules(), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        # An output continues its prompt: a SentencePiece-style leading space is text here.
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, skip_special_tokens, at_text_start=False) if tokenizer is not None else None
        )
        self._rules = rules
        self._stops = StopStringMatcher(rules.strings, rules.include_in_output)
        self._num_tokens = 0

    def push(self, token_ids: Sequence[int], final: bool, stop_token: bool = False) -> StopMatch:
        """The text these tokens add that is safe to send. final: no tokens follow, so nothing stays
        held back. stop_token: the last token is a stop token (EOS or a stop_token_ids entry) that
        ended the output; its text is left out unless the rules include it."""
        self._num_tokens += len(token_ids)
        if self._detokenizer is None:
            return StopMatch("", False)
        if stop_token and not self._rules.include_in_output:
            token_ids = token_ids[:-1]
        text = self._detokenize(token_ids)
        if self._num_tokens < self._rules.min_tokens:
            return StopMatch(text, False)  # too early for stop strings: nothing to hold back
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
