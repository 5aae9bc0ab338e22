"""Streaming detokenization: text deltas that never split a UTF-8 character."""

import codecs
from collections.abc import Sequence

from ember_core.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """push() returns the text completed by new tokens. The deltas concatenate to
    tokenizer.decode(all_ids, skip_special_tokens), less an unfinished character at the end (an
    output cut off mid-character), which never becomes text, as in vLLM."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Holds back the bytes of an unfinished character until the next token completes it.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        return self._utf8.decode(self._tokenizer.decode_bytes(token_ids, self._skip_special_tokens))
