"""Logprobs in OpenAI's two shapes: legacy completions and chat completions."""

from __future__ import annotations

import codecs
import math

from ember_core.tokenizer import Tokenizer
from ember_gateway.api.response_bodies import ChatLogprobs, CompletionLogprobs, TopLogprob
from ember_gateway.api.response_bodies import TokenLogprob as ChatTokenLogprob
from ember_proto import TokenLogprob

_NEG_INF_LOGPROB = -9999.0  # what OpenAI reports for impossible tokens; JSON has no -inf


def token_bytes(tokenizer: Tokenizer | None, token_id: int) -> bytes | None:
    if tokenizer is None:
        return None
    try:
        return tokenizer.decode_bytes([token_id])
    except ValueError:
        return b""


def token_string(tokenizer: Tokenizer | None, token_id: int) -> str:
    """The token as text; a token that is only part of a UTF-8 character is written as its bytes,
    and without a tokenizer a token is written as its id (as vLLM does)."""
    data = token_bytes(tokenizer, token_id)
    if data is None:
        return f"token_id:{token_id}"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _NEG_INF_LOGPROB


class TextOffsets:
    """Where each token's text starts in a choice's text, counting characters as the detokenizer
    emits them (a token that ends inside a character adds nothing until the character completes)."""

    def __init__(self, tokenizer: Tokenizer | None, start: int, skip_special_tokens: bool = True) -> None:
        """skip_special_tokens: as the text the offsets point into (generated text skips them, an
        echoed prompt keeps them)."""
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = start
        self._skip_special_tokens = skip_special_tokens

    def next(self, token_id: int) -> int:
        offset = self._offset
        if self._tokenizer is not None:
            try:
                data = self._tokenizer.decode_bytes([token_id], skip_special_tokens=self._skip_special_tokens)
            except ValueError:
                data = b""
            self._offset += len(self._utf8.decode(data))
        return offset


def completion_logprobs(
    tokenizer: Tokenizer | None, entries: list[TokenLogprob], offsets: TextOffsets
) -> CompletionLogprobs:
    """As OpenAI documents, each top_logprobs dict also holds the sampled token."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        token = token_string(tokenizer, entry.token_id)
        top = {token_string(tokenizer, token_id): _finite(logprob) for token_id, logprob in entry.top_logprobs}
        top.setdefault(token, _finite(entry.logprob))
        tokens.append(token)
        token_logprobs.append(_finite(entry.logprob))
        top_logprobs.append(top)
        text_offset.append(offsets.next(entry.token_id))
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


def echoed_prompt_logprobs(
    tokenizer: Tokenizer | None, prompt_ids: list[int], entries: list[TokenLogprob]
) -> CompletionLogprobs:
    """Completions logprobs of an echoed prompt: its first token has none, nothing precedes it."""
    offsets = TextOffsets(tokenizer, 0, skip_special_tokens=False)
    first = CompletionLogprobs(tokens=[token_string(tokenizer, prompt_ids[0])], token_logprobs=[None],
                               top_logprobs=[None], text_offset=[offsets.next(prompt_ids[0])])
    return first + completion_logprobs(tokenizer, entries, offsets)


def chat_logprobs(tokenizer: Tokenizer | None, entries: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for entry in entries:
        sampled = _top_logprob(tokenizer, entry.token_id, entry.logprob)
        top = [_top_logprob(tokenizer, token_id, logprob) for token_id, logprob in entry.top_logprobs]
        content.append(
            ChatTokenLogprob(token=sampled.token, logprob=sampled.logprob, bytes=sampled.bytes, top_logprobs=top)
        )
    return ChatLogprobs(content=content, refusal=None)


def _top_logprob(tokenizer: Tokenizer | None, token_id: int, logprob: float) -> TopLogprob:
    data = token_bytes(tokenizer, token_id)
    return TopLogprob(
        token=token_string(tokenizer, token_id), logprob=_finite(logprob), bytes=None if data is None else list(data)
    )
