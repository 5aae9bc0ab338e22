"""Tokenizer from the tokenizer.* metadata of a GGUF file (byte-level BPE vocabularies only)."""

from typing import Any

from ember_core.tokenizer.pretokenizers import GGUF_PRE_ADDS_BOS, gguf_pre_pattern
from ember_core.tokenizer.tokenizer import Tokenizer
from ember_core.tokenizer.vocab import build_spec

# llama.cpp's token types (gguf.TokenType).
_NORMAL = 1
_USER_DEFINED = 4


def tokenizer_from_gguf(reader: Any) -> Tokenizer:
    """reader is a gguf.GGUFReader; only its `fields` are read."""
    fields = reader.fields

    def value(key: str, default: Any = None) -> Any:
        return fields[key].contents() if key in fields else default

    model = value("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; "
            "only 'gpt2' (byte-level BPE) is supported"
        )
    pre = value("tokenizer.ggml.pre")
    pattern = gguf_pre_pattern(pre)
    tokens: list[str] = value("tokenizer.ggml.tokens")
    token_types: list[int] = value("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    merges = []
    for merge in value("tokenizer.ggml.merges", []):
        left, space, right = merge.partition(" ")
        if not space:
            raise ValueError(f"malformed GGUF merge {merge!r}")
        merges.append((left, right))

    vocab: dict[str, int] = {}
    special_tokens: dict[str, int] = {}
    added_tokens: dict[str, int] = {}
    for token_id, (text, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if token_type == _NORMAL:
            vocab[text] = token_id
        elif token_type == _USER_DEFINED:
            added_tokens[text] = token_id
        else:
            # Control, unknown and unused tokens: never plain text.
            special_tokens[text] = token_id

    end_of_turn = [value(key) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    spec = build_spec(
        vocab=vocab,
        merges=merges,
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        pattern=pattern,
        bos_token_id=value("tokenizer.ggml.bos_token_id"),
        eos_token_id=value("tokenizer.ggml.eos_token_id"),
        extra_stop_ids=[token_id for token_id in end_of_turn if token_id is not None],
        chat_template=value("tokenizer.chat_template"),
        add_bos_token=value("tokenizer.ggml.add_bos_token", pre in GGUF_PRE_ADDS_BOS),
    )
    return Tokenizer(spec)
