"""GGUF tokenizer metadata from a checkpoint's tokenizer.json, as llama.cpp reads it.

Byte-level BPE becomes `tokenizer.ggml.model = "gpt2"` with merges and the llama.cpp
pre-tokenizer whose regex the tokenizer.json uses; BPE with byte fallback (SentencePiece
style) becomes `"llama"` with scores. Special token ids, add_bos/add_eos and the chat template
come from gguf's SpecialVocab, as convert_hf_to_gguf.py takes them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf

SPM_SPACE = "\u2581"
# The Split regexes of Llama 3's and Qwen2's tokenizer.json, and llama.cpp's names for them.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE_NAMES = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_ADDED_TOKEN_SCORE = -1000.0  # convert_hf_to_gguf's score for added and unused tokens


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """Write the tokenizer of model_dir (nothing when it has no tokenizer.json), padded with
    `[PADn]` tokens to vocab_size as convert_hf_to_gguf.py pads."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: tokenizer model type {model.get('type')!r} is not supported; expected BPE")
    ids = {**model["vocab"], **{added["content"]: added["id"] for added in spec.get("added_tokens", [])}}
    if max(ids.values()) >= vocab_size:
        raise ValueError(f"{path}: token id {max(ids.values())} is outside the model's vocab_size {vocab_size}")
    if model.get("byte_fallback", False):
        _add_sentencepiece_style(writer, spec, vocab_size)
        special = gguf.SpecialVocab(model_dir, n_vocab=vocab_size)
    elif _is_byte_level(spec):
        _add_byte_level(writer, spec, vocab_size)
        special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    else:
        raise ValueError(f"{path}: a BPE tokenizer without ByteLevel or byte_fallback is not supported")
    # llama.cpp adds BOS by default for some tokenizers: say what this one does.
    special.add_special_token.setdefault("bos", False)
    special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(writer, quiet=True)


def _add_byte_level(writer: gguf.GGUFWriter, spec: dict[str, Any], vocab_size: int) -> None:
    tokens, types = _padded_tokens(spec, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_name(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def _add_sentencepiece_style(writer: gguf.GGUFWriter, spec: dict[str, Any], vocab_size: int) -> None:
    tokens, types = _padded_tokens(spec, vocab_size)
    unk = spec["model"].get("unk_token")
    merge_rank = _first_merge_rank(spec["model"].get("merges", []))
    scores = []
    for index, token in enumerate(tokens):
        if token == unk:
            types[index] = gguf.TokenType.UNKNOWN
        elif types[index] == gguf.TokenType.NORMAL and _BYTE_TOKEN.fullmatch(token):
            types[index] = gguf.TokenType.BYTE
        if types[index] == gguf.TokenType.NORMAL:
            # llama.cpp merges the pair whose joined token scores highest: the earliest merge.
            scores.append(-float(merge_rank.get(token, 0)))
        elif types[index] == gguf.TokenType.BYTE:
            scores.append(0.0)
        else:
            scores.append(_ADDED_TOKEN_SCORE)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(_prepends_space(spec))


def _padded_tokens(spec: dict[str, Any], vocab_size: int) -> tuple[list[str], list[gguf.TokenType]]:
    tokens = [f"[PAD{index}]" for index in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, token_id in spec["model"]["vocab"].items():
        tokens[token_id], types[token_id] = token, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        content, token_id = added["content"], added["id"]
        if added.get("special", False) or _looks_special(content):
            tokens[token_id], types[token_id] = content, gguf.TokenType.CONTROL
        else:  # llama.cpp expects user-defined tokens pre-normalized
            tokens[token_id], types[token_id] = content.replace(SPM_SPACE, " "), gguf.TokenType.USER_DEFINED
    return tokens, types


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's list of added tokens that are control tokens even when not marked special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _first_merge_rank(merges: list[str | list[str]]) -> dict[str, int]:
    rank: dict[str, int] = {}
    for index, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, index)
    return rank


def _is_byte_level(spec: dict[str, Any]) -> bool:
    return any(step["type"] == "ByteLevel" for step in _steps(spec.get("pre_tokenizer")))


def _pre_name(pre_tokenizer: dict[str, Any] | None) -> str:
    steps = _steps(pre_tokenizer)
    kinds = [step["type"] for step in steps]
    byte_level_regex = bool(steps and steps[-1]["type"] == "ByteLevel" and steps[-1].get("use_regex", True))
    if kinds == ["ByteLevel"] and byte_level_regex:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and byte_level_regex and steps[0].get("individual_digits", False):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not byte_level_regex and steps[0].get("behavior") == "Isolated":
        name = _SPLIT_PRE_NAMES.get(steps[0]["pattern"].get("Regex", ""))
        if name is not None:
            return name
    raise ValueError(
        f"no llama.cpp pre-tokenizer is known to match the tokenizer.json pre_tokenizer {kinds}; "
        "supported: ByteLevel (gpt-2), Digits+ByteLevel (smollm), Split+ByteLevel with Llama 3's or Qwen2's regex"
    )


def _prepends_space(spec: dict[str, Any]) -> bool:
    normalizers = _steps(spec.get("normalizer"), "normalizers")
    if any(step["type"] == "Prepend" and step.get("prepend") == SPM_SPACE for step in normalizers):
        return True
    return any(
        step["type"] == "Metaspace" and step.get("prepend_scheme", "always") != "never"
        for step in _steps(spec.get("pre_tokenizer"))
    )


def _steps(component: dict[str, Any] | None, children: str = "pretokenizers") -> list[dict[str, Any]]:
    if component is None:
        return []
    if component["type"] == "Sequence":
        return [step for inner in component[children] for step in _steps(inner, children)]
    return [component]
