"""A SentencePiece tokenizer (tokenizer.ggml.model = "llama") from GGUF metadata, on HF tokenizers.

Built as transformers' GGUF loader builds it, so that ids equal its tokenizer's: a BPE with byte
fallback over the file's tokens, with the file's merges or else merges derived from the token
scores, in the pipeline of the architecture's tokenizer (sentencepiece_pipelines.py).
"""

from collections.abc import Sequence
from functools import partial
from typing import Any

import tokenizers
from tokenizers import models

from ember_core.tokenizer.gguf_fields import (
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    end_of_turn_ids,
    field_value,
    merge_pair,
)
from ember_core.tokenizer.sentencepiece_pipelines import (
    METASPACE,
    use_gemma_pipeline,
    use_llama_pipeline,
    use_phi3_pipeline,
)
from ember_core.tokenizer.sentencepiece_style import sentencepiece_spec
from ember_core.tokenizer.tokenizer import Tokenizer

_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
_NAMED_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def sentencepiece_from_gguf(fields: dict[str, Any]) -> Tokenizer:
    value = partial(field_value, fields)
    architecture = value("general.architecture")
    tokens: list[str] = list(value("tokenizer.ggml.tokens"))
    token_types: list[int] = list(value("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    if architecture in _GEMMA_ARCHITECTURES:
        # Gemma files write the tokens made of spaces with real spaces, where its vocabulary has "▁";
        # and its scores do not follow its merge order, which is the order of the tokens.
        tokens = [METASPACE * len(token) if token and not token.strip(" ") else token for token in tokens]
        priorities: Sequence[float] = range(0, -len(tokens), -1)
    else:
        priorities = value("tokenizer.ggml.scores")
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in fields:
        merges = [merge_pair(merge) for merge in value("tokenizer.ggml.merges")]
    elif priorities is not None:
        merges = merges_by_priority(vocab, dict(zip(tokens, priorities)))
    else:
        raise ValueError("GGUF SentencePiece vocabulary with neither tokenizer.ggml.merges nor tokenizer.ggml.scores")

    unknown_id = value("tokenizer.ggml.unknown_token_id")
    tokenizer = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=None if unknown_id is None else tokens[unknown_id],
        )
    )
    if architecture in _GEMMA_ARCHITECTURES:
        use_gemma_pipeline(tokenizer)
    elif architecture == "phi3":
        use_phi3_pipeline(tokenizer)
    else:
        use_llama_pipeline(tokenizer, add_prefix_space=value("tokenizer.ggml.add_space_prefix", True), legacy=False)

    named_ids = {value(f"tokenizer.ggml.{key}") for key in _NAMED_IDS} - {None}
    special, user_defined = [], []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if token_type in (CONTROL, UNKNOWN) or token_id in named_ids:
            special.append(tokenizers.AddedToken(token, normalized=False, special=True))
        elif token_type == USER_DEFINED:
            user_defined.append(tokenizers.AddedToken(token, normalized=False, special=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user_defined)

    spec = sentencepiece_spec(
        tokenizer,
        bos_token_id=value("tokenizer.ggml.bos_token_id"),
        eos_token_id=value("tokenizer.ggml.eos_token_id"),
        extra_stop_ids=end_of_turn_ids(fields),
        chat_template=value("tokenizer.chat_template"),
        # llama.cpp puts BOS in front of a SentencePiece prompt unless the file says otherwise.
        add_bos_token=value("tokenizer.ggml.add_bos_token", True),
    )
    return Tokenizer(spec)


def merges_by_priority(vocab: dict[str, int], priority_of: dict[str, float]) -> list[tuple[str, str]]:
    """Every way to build a token from two vocabulary tokens, best first: by the priority of the
    token it builds, then the longer left part, then the longer right part, then the token's place
    in priority_of and the ids of the parts. transformers derives this order for a vocabulary
    without merges (and llama.cpp merges by the built token's score)."""
    candidates: list[tuple[float, str, str]] = []
    for token, priority in priority_of.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        known = [(left, right) for left, right in pairs if left in vocab and right in vocab]
        known.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates += [(priority, left, right) for left, right in known]
    candidates.sort(key=lambda candidate: (-candidate[0], -len(candidate[1]), -len(candidate[2])))
    return [(left, right) for _, left, right in candidates]

