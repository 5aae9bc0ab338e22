"""Byte-level BPE on tiktoken: the encoder and the bytes of every token, rebuilt from a TokenizerSpec."""

import re

import regex
import tiktoken

from ember_core.tokenizer.spec import TokenizerSpec


class TiktokenBpe:
    spaces_stripped_at_start = 0

    def __init__(self, spec: TokenizerSpec) -> None:
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
        self.token_bytes: list[bytes | None] = [bytes_by_id.get(token_id) for token_id in range(max(bytes_by_id) + 1)]

        self._missing_bytes = bytes(byte for byte in range(256) if bytes([byte]) not in spec.mergeable_ranks)
        if self._missing_bytes:
            self._has_missing_byte = re.compile(b"[" + re.escape(self._missing_bytes) + b"]").search
            self._pieces = regex.compile(spec.pattern).findall

    def encode(self, text: str, allow_special: bool) -> list[int]:
        allowed = self._all_matched if allow_special else self._always_matched
        if self._missing_bytes and self._has_missing_byte(text.encode()):
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


def _split_on(text: str, tokens: frozenset[str]) -> list[str]:
    """text cut around every occurrence of tokens (longest first); the tokens stay as segments."""
    if not tokens:
        return [text]
    alternatives = "|".join(re.escape(token) for token in sorted(tokens, key=len, reverse=True))
    return [segment for segment in re.split(f"({alternatives})", text) if segment]
