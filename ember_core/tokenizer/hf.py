"""Tokenizer from a Hugging Face model directory: tokenizer.json, or vocab.json + merges.txt.

Only GPT-2 style byte-level BPE is supported; anything else is rejected with the reason.
"""

import json
from pathlib import Path
from typing import Any

from ember_core.tokenizer.byte_level import BYTE_TO_CHAR
from ember_core.tokenizer.pretokenizers import GPT2, hf_pre_pattern
from ember_core.tokenizer.tokenizer import Tokenizer
from ember_core.tokenizer.vocab import build_spec

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_SPECIAL_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")


def load_hf_tokenizer(model_dir: Path) -> Tokenizer | None:
    """None when model_dir has no tokenizer files."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "tokenizer_config.json")
    special_tokens_map = _read_json(model_dir / "special_tokens_map.json")
    added_by_text: dict[str, tuple[int, bool]] = {}  # text -> (id, special)
    if (model_dir / "tokenizer.json").is_file():
        tokenizer_json = _read_json(model_dir / "tokenizer.json")
        vocab, merges = _bpe_model(tokenizer_json)
        pattern = hf_pre_pattern(tokenizer_json.get("pre_tokenizer"))
        for entry in tokenizer_json.get("added_tokens", []):
            added_by_text[entry["content"]] = (entry["id"], entry.get("special", False))
        post_processor = tokenizer_json.get("post_processor")
    elif (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file():
        vocab = _read_json(model_dir / "vocab.json")
        merges = _read_merges_txt(model_dir / "merges.txt")
        pattern = GPT2
        for text, token_id in _read_json(model_dir / "added_tokens.json").items():
            added_by_text[text] = (token_id, False)
        post_processor = None
    else:
        return None

    for token_id, entry in config.get("added_tokens_decoder", {}).items():
        added_by_text[entry["content"]] = (int(token_id), entry.get("special", False))
    for source in (special_tokens_map, config):
        for text in _named_special_token_texts(source):
            token_id = added_by_text[text][0] if text in added_by_text else vocab.get(text)
            if token_id is not None:
                added_by_text[text] = (token_id, True)
    special_tokens = {text: token_id for text, (token_id, special) in added_by_text.items() if special}
    added_tokens = {text: token_id for text, (token_id, special) in added_by_text.items() if not special}

    def token_id_of(name: str) -> int | None:
        text = _token_text(config.get(name)) or _token_text(special_tokens_map.get(name))
        if text is None:
            return None
        return special_tokens.get(text, added_tokens.get(text, vocab.get(text)))

    model_config = _read_json(model_dir / "config.json")
    bos_token_id = token_id_of("bos_token")
    if bos_token_id is None:
        bos_token_id = _first_id(model_config.get("bos_token_id"))
    eos_token_id = token_id_of("eos_token")
    if eos_token_id is None:
        eos_token_id = _first_id(model_config.get("eos_token_id"))
    generation_config = _read_json(model_dir / "generation_config.json")
    extra_stop_ids = [*_ids(model_config.get("eos_token_id")), *_ids(generation_config.get("eos_token_id"))]

    if post_processor is not None:
        bos_text = _token_text(config.get("bos_token")) or _token_text(special_tokens_map.get("bos_token"))
        add_bos_token = _post_processor_adds(post_processor, bos_text)
    else:
        add_bos_token = bool(config.get("add_bos_token", False))

    spec = build_spec(
        vocab=vocab,
        merges=merges,
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        pattern=pattern,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        extra_stop_ids=extra_stop_ids,
        chat_template=_chat_template(model_dir, config),
        add_bos_token=add_bos_token,
    )
    return Tokenizer(spec)


def _bpe_model(tokenizer_json: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = tokenizer_json["model"]
    model_type = model.get("type", "BPE")
    if model_type != "BPE":
        raise ValueError(
            f"unsupported tokenizer.json model type {model_type!r}; only GPT-2 style byte-level BPE is supported"
        )
    if model.get("byte_fallback"):
        raise ValueError(
            "unsupported tokenizer.json: BPE with byte_fallback (sentencepiece style); "
            "only GPT-2 style byte-level BPE is supported"
        )
    for option in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            raise ValueError(f"unsupported tokenizer.json: BPE with {option}={model[option]!r}")
    normalizer = tokenizer_json.get("normalizer")
    if normalizer is not None:
        raise ValueError(f"unsupported tokenizer.json normalizer {normalizer.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    if model.get("unk_token") is not None and any(char not in vocab for char in BYTE_TO_CHAR.values()):
        # HF would emit the unk token for those bytes; we only implement dropping them.
        raise ValueError("unsupported tokenizer.json: a BPE unk_token with bytes that have no token")
    merges = [_merge_pair(merge) for merge in model.get("merges", [])]
    return vocab, merges


def _merge_pair(merge: str | list[str]) -> tuple[str, str]:
    parts = merge.split(" ") if isinstance(merge, str) else merge
    if len(parts) != 2:
        raise ValueError(f"malformed merge {merge!r}")
    return parts[0], parts[1]


def _read_merges_txt(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [_merge_pair(line) for line in lines if line and not line.startswith("#version")]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        return json.load(file)


def _token_text(value: str | dict[str, Any] | None) -> str | None:
    """Special tokens are saved as plain strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _named_special_token_texts(source: dict[str, Any]) -> list[str]:
    texts = [_token_text(source.get(name)) for name in _NAMED_SPECIAL_TOKENS]
    for name in _SPECIAL_TOKEN_LISTS:
        listed = source.get(name) or []
        texts.extend(_token_text(value) for value in (listed.values() if isinstance(listed, dict) else listed))
    return [text for text in texts if text]


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _first_id(value: int | list[int] | None) -> int | None:
    ids = _ids(value)
    return ids[0] if ids else None


def _post_processor_adds(post_processor: dict[str, Any], bos_text: str | None) -> bool:
    """Whether a TemplateProcessing post-processor puts BOS in front of a single sequence."""
    steps = post_processor.get("processors", [post_processor])
    for step in steps:
        if step.get("type") == "TemplateProcessing" and step.get("single"):
            first = step["single"][0]
            return "SpecialToken" in first and first["SpecialToken"]["id"] == bos_text
    return False


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    # As in transformers, a chat_template.jinja file wins over the config's entry.
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template
