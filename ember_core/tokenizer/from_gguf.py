"""Tokenizer from the tokenizer.* metadata of a GGUF file: byte-level BPE ("gpt2") on tiktoken,
SentencePiece ("llama") on HF tokenizers (gguf_sentencepiece.py)."""

from functools import partial
from typing import Any

from ember_core.tokenizer.gguf_fields import NORMAL, USER_DEFINED, end_of_turn_ids, field_value, merge_pair
from ember_core.tokenizer.gguf_sentencepiece import sentencepiece_from_gguf
from ember_core.tokenizer.pretokenizers import GGUF_PRE_ADDS_BOS, gguf_pre_pattern
from ember_core.tokenizer.tokenizer import Tokenizer
from ember_core.tokenizer.vocab import build_spec

_MODELS = "'gpt2' (byte-level BPE), 'llama' (SentencePiece)"


def tokenizer_from_gguf(reader: Any) -> Tokenizer | None:
    """reader is a gguf.GGUFReader; only its `fields` are read. None when the file has no tokenizer
    (a model served on token ids, as a Hugging Face directory without tokenizer files)."""
    fields = reader.fields
    model = field_value(fields, "tokenizer.ggml.model")
    if model is None and "tokenizer.ggml.tokens" not in fields:
        return None
    if model == "llama":
        return sentencepiece_from_gguf(fields)
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; supported: {_MODELS}")
    return _byte_level_from_gguf(fields)


def _byte_level_from_gguf(fields: dict[str, Any]) -> Tokenizer:
    value = partial(field_value, fields)
    pre = value("tokenizer.ggml.pre")
    pattern = gguf_pre_pattern(pre)
    tokens: list[str] = value("tokenizer.ggml.tokens")
    token_types: list[int] = value("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    merges = [merge_pair(merge) for merge in value("tokenizer.ggml.merges", [])]

    vocab: dict[str, int] = {}
    special_tokens: dict[str, int] = {}
    added_tokens: dict[str, int] = {}
    for token_id, (text, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if token_type == NORMAL:
            vocab[text] = token_id
        elif token_type == USER_DEFINED:
            added_tokens[text] = token_id
        else:
            # Control, unknown and unused tokens: never plain text.
            special_tokens[text] = token_id

    spec = build_spec(
        vocab=vocab,
        merges=merges,
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        pattern=pattern,
        bos_token_id=value("tokenizer.ggml.bos_token_id"),
        eos_token_id=value("tokenizer.ggml.eos_token_id"),
        extra_stop_ids=end_of_turn_ids(fields),
        chat_template=value("tokenizer.chat_template"),
        add_bos_token=value("tokenizer.ggml.add_bos_token", pre in GGUF_PRE_ADDS_BOS),
    )
    return Tokenizer(spec)
