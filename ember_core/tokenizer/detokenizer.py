"""Streaming detokenization: text deltas that never split a UTF-8 character."""

import codecs
from collections.abc import Sequence

from ember_core.tokenizer.tokenizer import Tokenizer, strip_spaces_at_start


class IncrementalDetokenizer:
    """push() returns the text completed by new tokens. The deltas concatenate to
    tokenizer.decode(all_ids, skip_special_tokens), less an unfinished character at the end (an
    output cut off mid-character), which never becomes text, as in vLLM.

    at_text_start=False: the tokens continue a text (a generation continues its prompt), so the
    leading space a SentencePiece-style decoder drops at the start of a text stays, as vLLM keeps it:
    "The capital of France is" + " Paris"."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, at_text_start: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Holds back the bytes of an unfinished character until the next token completes it.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # The spaces decode() drops at the start of the text, while no other byte came.
        self._spaces_to_strip = tokenizer.spaces_stripped_at_start if at_text_start else 0

    def push(self, token_ids: Sequence[int]) -> str:
        data = self._tokenizer.decode_bytes(token_ids, self._skip_special_tokens)
        if self._spaces_to_strip and data:
            kept = strip_spaces_at_start(data, self._spaces_to_strip)
            stripped = len(data) - len(kept)
            self._spaces_to_strip = self._spaces_to_strip - stripped if not kept else 0
            data = kept
        return self._utf8.decode(data)
