"""Byte-level BPE tokenizer on tiktoken, rebuilt from a TokenizerSpec."""

import re
from collections.abc import Iterable, Sequence
from typing import Any

import regex
import tiktoken

from ember_core.tokenizer.chat_template import render_chat
from ember_core.tokenizer.spec import TokenizerSpec


class Tokenizer:
    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        matched_tokens = {**spec.special_tokens, **spec.added_tokens}
        if spec.rank_to_id is None:
            tiktoken_specials = matched_tokens
            self._rank_to_id: list[int] | None = None
        else:
            # tiktoken hands out special tokens from the same number space as ranks.
            first = len(spec.rank_to_id)
            tiktoken_specials = {text: first + index for index, text in enumerate(matched_tokens)}
            self._rank_to_id = [*spec.rank_to_id, *matched_tokens.values()]
        self._encoding = tiktoken.Encoding(
            name="ember", pat_str=spec.pattern, mergeable_ranks=spec.mergeable_ranks, special_tokens=tiktoken_specials
        )
        self._tiktoken_specials = tiktoken_specials
        self._always_matched = frozenset(spec.added_tokens)
        self._all_matched = frozenset(matched_tokens)

        rank_to_id = spec.rank_to_id
        bytes_by_id = {
            (rank if rank_to_id is None else rank_to_id[rank]): data for data, rank in spec.mergeable_ranks.items()
        }
        bytes_by_id.update(spec.decode_only_tokens)
        bytes_by_id.update((token_id, text.encode()) for text, token_id in matched_tokens.items())
        self.vocab_size = max(bytes_by_id) + 1
        self._bytes_by_id: list[bytes | None] = [bytes_by_id.get(token_id) for token_id in range(self.vocab_size)]
        self._bytes_by_id_without_special = list(self._bytes_by_id)
        for token_id in spec.special_tokens.values():
            self._bytes_by_id_without_special[token_id] = b""

        self._missing_bytes = bytes(byte for byte in range(256) if bytes([byte]) not in spec.mergeable_ranks)
        if self._missing_bytes:
            self._has_missing_byte = re.compile(b"[" + re.escape(self._missing_bytes) + b"]").search
            self._pieces = regex.compile(spec.pattern).findall
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
        allowed = self._all_matched if allow_special else self._always_matched
        if self._missing_bytes and self._has_missing_byte(text.encode("utf-8", "surrogatepass")):
            # Lone surrogates become U+FFFD, as tiktoken does on the other path.
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            ranks = self._encode_without_missing_bytes(text, allowed)
        else:
            ranks = self._encoding.encode(text, allowed_special=allowed, disallowed_special=())
        if self._rank_to_id is None:
            return ranks
        rank_to_id = self._rank_to_id
        return [rank_to_id[rank] for rank in ranks]

    def _encode_without_missing_bytes(self, text: str, allowed: frozenset[str]) -> list[int]:
        # Some vocabularies have no token for a few bytes. HF tokenizers' BPE (the reference these
        # vocabularies come from, with no unk token) drops such characters after pre-tokenization
        # and merges their neighbours as if they were adjacent; tiktoken would panic on them. So
        # this rare path pre-tokenizes here, drops those bytes per piece and lets tiktoken merge
        # what is left (tiktoken's piece encoder takes bytes, which need not be valid UTF-8 here).
        ranks: list[int] = []
        for segment in _split_on(text, allowed):
            if segment in allowed:
                ranks.append(self._tiktoken_specials[segment])
                continue
            for piece in self._pieces(segment):
                kept = piece.encode().translate(None, self._missing_bytes)
                if kept:
                    ranks.extend(self._encoding._encode_single_piece(kept))
        return ranks

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        table = self._bytes_by_id_without_special if skip_special_tokens else self._bytes_by_id
        try:
            if ids and min(ids) < 0:
                raise IndexError
            return b"".join(map(table.__getitem__, ids))
        except (IndexError, TypeError):
            raise ValueError(self._describe_bad_ids(ids)) from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

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


def _split_on(text: str, tokens: frozenset[str]) -> list[str]:
    """text cut around every occurrence of tokens (longest first); the tokens stay as segments."""
    if not tokens:
        return [text]
    alternatives = "|".join(re.escape(token) for token in sorted(tokens, key=len, reverse=True))
    return [segment for segment in re.split(f"({alternatives})", text) if segment]
