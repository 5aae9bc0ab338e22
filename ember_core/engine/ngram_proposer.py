"""Prompt lookup: draft tokens for a sequence from its own prompt and output, no draft model."""

from __future__ import annotations

from array import array

_ITEM = array("i").itemsize


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for the longest n in [min_n, max_n] that occurs earlier; [] when none does."""
    if num_tokens < 1 or len(token_ids) <= min_n:
        return []
    # bytes.rfind searches in C; a match must start on a token boundary.
    data = array("i", token_ids).tobytes()
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        suffix = data[-n * _ITEM :]
        end = len(data) - _ITEM  # a match must end before the last token (it cannot be the suffix itself)
        while (found := data.rfind(suffix, 0, end)) >= 0:
            if found % _ITEM == 0:
                start = found // _ITEM + n
                return token_ids[start : start + num_tokens]
            end = found + len(suffix) - 1
    return []
