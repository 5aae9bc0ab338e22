"""The tokenizer the engine and the gateways use, rebuilt from a TokenizerSpec: byte-level BPE on
tiktoken, or a SentencePiece-style tokenizer.json on HF tokenizers."""

import re
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ember_core.tokenizer.chat_template import render_chat
from ember_core.tokenizer.sentencepiece_style import SentencePieceStyle
from ember_core.tokenizer.spec import TokenizerSpec
from ember_core.tokenizer.tiktoken_bpe import TiktokenBpe

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class _Backend(Protocol):
    # token_bytes[id]: the bytes of a token in the middle of the text; None where no token has the id.
    token_bytes: list[bytes | None]
    # Decoding drops up to this many spaces at the start of the text (SentencePiece's dummy prefix).
    spaces_stripped_at_start: int

    def encode(self, text: str, allow_special: bool) -> list[int]: ...


class Tokenizer:
    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._backend: _Backend = (
            TiktokenBpe(spec) if spec.tokenizer_json is None else SentencePieceStyle(spec.tokenizer_json)
        )
        self._bytes_by_id = self._backend.token_bytes
        self.vocab_size = len(self._bytes_by_id)
        self._bytes_by_id_without_special = list(self._bytes_by_id)
        for token_id in spec.special_tokens.values():
            self._bytes_by_id_without_special[token_id] = b""
        self.spaces_stripped_at_start = self._backend.spaces_stripped_at_start
        self.stop_token_ids = frozenset(spec.stop_token_ids)

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> "Tokenizer":
        return cls(spec)

    @property
    def bos_token_id(self) -> int | None:
        return self.spec.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.spec.eos_token_id

    @property
    def special_tokens(self) -> dict[str, int]:
        return self.spec.special_tokens

    @property
    def added_tokens(self) -> dict[str, int]:
        return self.spec.added_tokens

    @property
    def chat_template(self) -> str | None:
        return self.spec.chat_template

    @property
    def add_bos_token(self) -> bool:
        return self.spec.add_bos_token

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of text. Control tokens written in text count only when allow_special is set;
        otherwise they are encoded as the plain text they are."""
        if _LONE_SURROGATE.search(text):
            # Lone surrogates become U+FFFD, as tiktoken does.
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if self.spec.unicode_normalization:
            text = unicodedata.normalize(self.spec.unicode_normalization, text)  # type: ignore[arg-type]
        return self._backend.encode(text, allow_special)

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        """The bytes of the tokens as they stand in the middle of a text: with the space a
        SentencePiece token's "▁" stands for even at the start (decode() drops it there)."""
        table = self._bytes_by_id_without_special if skip_special_tokens else self._bytes_by_id
        try:
            if ids and min(ids) < 0:
                raise IndexError
            return b"".join(map(table.__getitem__, ids))
        except (IndexError, TypeError):
            raise ValueError(self._describe_bad_ids(ids)) from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """HF tokenizers' decode, but for bytes that spell no character: one U+FFFD per invalid
        sequence, where HF's ByteFallback writes one per byte token of such a run, including the
        characters before it, which a stream has already sent."""
        data = self.decode_bytes(ids, skip_special_tokens)
        return strip_spaces_at_start(data, self.spaces_stripped_at_start).decode("utf-8", errors="replace")

    def _describe_bad_ids(self, ids: Iterable[int]) -> str:
        bad = next(id_ for id_ in ids if not 0 <= id_ < self.vocab_size or self._bytes_by_id[id_] is None)
        if not 0 <= bad < self.vocab_size:
            return f"token id {bad} is out of range for a vocabulary of {self.vocab_size} ids"
        return f"token id {bad} has no token in the vocabulary"

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            **extra,
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        return self.encode_prompt(self.render_chat(messages, add_generation_prompt, **extra))

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the model expects it: special tokens written in the text are recognised (as
        HF tokenizers do) and BOS is put in front when the model wants one and the text lacks it."""
        ids = self.encode(text, allow_special=True)
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.decode([token_id])


def strip_spaces_at_start(data: bytes, count: int) -> bytes:
    """data less up to count spaces at its start."""
    head = data[:count]
    return data[len(head) - len(head.lstrip(b" ")) :]
