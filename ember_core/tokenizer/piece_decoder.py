"""The bytes each token of a SentencePiece-style vocabulary stands for, read off its tokenizer.json
decoder: Replace("▁", " ") steps, ByteFallback ("<0xAB>" is that byte), Fuse, and a Strip of the
spaces that start the text (the dummy prefix SentencePiece puts in front)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SUPPORTED_DECODER = "Sequence[Replace(String)..., ByteFallback, Fuse, Strip(' ', stop=0)]"


@dataclass(frozen=True)
class PieceDecoder:
    replacements: tuple[tuple[str, str], ...]  # (pattern, content) of each Replace step, in order
    byte_fallback: bool
    # Decoding drops up to this many spaces at the start of the text.
    spaces_stripped_at_start: int

    def token_bytes(self, token: str) -> bytes:
        """The bytes of a token in the middle of the text."""
        for pattern, content in self.replacements:
            token = token.replace(pattern, content)
        if self.byte_fallback and (match := _BYTE_TOKEN.fullmatch(token)):
            return bytes([int(match[1], 16)])
        return token.encode()


def piece_decoder(decoder: dict[str, Any] | None) -> PieceDecoder:
    """decoder is the tokenizer.json entry; a ValueError names what is not supported."""
    if decoder is None:
        raise ValueError(f"unsupported tokenizer.json without a decoder; supported: {SUPPORTED_DECODER}")
    steps = decoder["decoders"] if decoder["type"] == "Sequence" else [decoder]
    kinds = [step["type"] for step in steps]
    order = ["Replace"] * kinds.count("Replace") + [kind for kind in ("ByteFallback", "Fuse", "Strip") if kind in kinds]
    if kinds != order or ("Strip" in kinds and "Fuse" not in kinds):
        # Replace after ByteFallback would rewrite decoded bytes, a Strip before Fuse strips every token.
        described = f"Sequence[{', '.join(kinds)}]" if decoder["type"] == "Sequence" else decoder["type"]
        raise ValueError(f"unsupported tokenizer.json decoder {described}; supported: {SUPPORTED_DECODER}")
    replacements = []
    for step in steps[: kinds.count("Replace")]:
        if "String" not in step["pattern"]:
            raise ValueError(f"unsupported tokenizer.json decoder Replace with pattern {step['pattern']!r}")
        replacements.append((step["pattern"]["String"], step["content"]))
    spaces_stripped = 0
    if "Strip" in kinds:
        strip = steps[-1]
        if strip["content"] != " " or strip["stop"] != 0:
            raise ValueError(f"unsupported tokenizer.json decoder Strip {strip!r}; only leading spaces are stripped")
        spaces_stripped = strip["start"]
    return PieceDecoder(tuple(replacements), "ByteFallback" in kinds, spaces_stripped)
