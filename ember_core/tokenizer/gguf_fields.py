"""Reading a GGUF file's tokenizer.* metadata, and llama.cpp's token types (gguf.TokenType)."""

from typing import Any

NORMAL = 1
UNKNOWN = 2
CONTROL = 3
USER_DEFINED = 4


def field_value(fields: dict[str, Any], key: str, default: Any = None) -> Any:
    """fields is a gguf.GGUFReader's `fields`."""
    return fields[key].contents() if key in fields else default


def end_of_turn_ids(fields: dict[str, Any]) -> list[int]:
    """The end-of-turn and end-of-message tokens a generation stops at besides EOS."""
    ids = [field_value(fields, key) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    return [token_id for token_id in ids if token_id is not None]


def merge_pair(merge: str) -> tuple[str, str]:
    """A tokenizer.ggml.merges entry: the two tokens it joins."""
    left, space, right = merge.partition(" ")
    if not space:
        raise ValueError(f"malformed GGUF merge {merge!r}")
    return left, right
