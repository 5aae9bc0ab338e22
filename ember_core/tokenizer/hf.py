"""Tokenizer from a Hugging Face model directory: tokenizer.json, or vocab.json + merges.txt.

GPT-2 style byte-level BPE runs on tiktoken; a SentencePiece-style tokenizer.json (metaspace, byte
fallback) on HF tokenizers (hf_sentencepiece.py). Anything else is rejected with the reason.
"""

from pathlib import Path
from typing import Any

UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")  # tokenizer.json normalizers that are one Unicode normal form

from ember_core.tokenizer.byte_level import BYTE_TO_CHAR
from ember_core.tokenizer.hf_config import HfTokenizerConfig, read_json
from ember_core.tokenizer.hf_sentencepiece import sentencepiece_style_tokenizer
from ember_core.tokenizer.pretokenizers import GPT2, hf_pre_pattern
from ember_core.tokenizer.tokenizer import Tokenizer
from ember_core.tokenizer.vocab import build_spec


def load_hf_tokenizer(model_dir: Path) -> Tokenizer | None:
    """None when model_dir has no tokenizer files."""
    model_dir = Path(model_dir)
    config = HfTokenizerConfig.read(model_dir)
    added_by_text: dict[str, tuple[int, bool]] = {}  # text -> (id, special)
    if (model_dir / "tokenizer.json").is_file():
        tokenizer_json = read_json(model_dir / "tokenizer.json")
        if not _is_byte_level(tokenizer_json):
            return sentencepiece_style_tokenizer(tokenizer_json, config)
        vocab, merges = _bpe_model(tokenizer_json)
        _unicode_normalization(tokenizer_json)  # refused before the vocabulary is built
        pattern = hf_pre_pattern(tokenizer_json.get("pre_tokenizer"))
        for entry in tokenizer_json.get("added_tokens", []):
            added_by_text[entry["content"]] = (entry["id"], entry.get("special", False))
    elif (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file():
        vocab = read_json(model_dir / "vocab.json")
        merges = _read_merges_txt(model_dir / "merges.txt")
        pattern = GPT2
        for text, token_id in read_json(model_dir / "added_tokens.json").items():
            added_by_text[text] = (token_id, False)
        tokenizer_json = None
    else:
        return None

    for token_id, entry in config.added_tokens_decoder().items():
        added_by_text[entry["content"]] = (token_id, entry.get("special", False))
    for text in [*config.named_special_token_texts(), *config.listed_special_token_texts()]:
        token_id = added_by_text[text][0] if text in added_by_text else vocab.get(text)
        if token_id is not None:
            added_by_text[text] = (token_id, True)
    special_tokens = {text: token_id for text, (token_id, special) in added_by_text.items() if special}
    added_tokens = {text: token_id for text, (token_id, special) in added_by_text.items() if not special}

    bos_token_id, eos_token_id = config.bos_and_eos_ids(
        lambda text: special_tokens.get(text, added_tokens.get(text, vocab.get(text)))
    )
    spec = build_spec(
        vocab=vocab,
        merges=merges,
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        pattern=pattern,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        extra_stop_ids=config.extra_stop_ids(),
        chat_template=config.chat_template,
        add_bos_token=config.adds_bos(tokenizer_json),
        unicode_normalization=_unicode_normalization(tokenizer_json),
    )
    return Tokenizer(spec)


def _unicode_normalization(tokenizer_json: dict[str, Any] | None) -> str:
    """The Unicode normal form tokenizer.json's normalizer applies ("NFC": Qwen's), "" for none;
    ValueError for another normalizer."""
    normalizer = (tokenizer_json or {}).get("normalizer")
    if normalizer is None:
        return ""
    if normalizer.get("type") not in UNICODE_FORMS:
        raise ValueError(f"unsupported tokenizer.json normalizer {normalizer.get('type')!r}; supported: {', '.join(UNICODE_FORMS)}")
    return normalizer["type"]


def _is_byte_level(tokenizer_json: dict[str, Any]) -> bool:
    """A SentencePiece-style tokenizer has no ByteLevel step; a GPT-2 style one decodes with ByteLevel."""
    decoder = tokenizer_json.get("decoder") or {}
    pre_tokenizer = tokenizer_json.get("pre_tokenizer") or {}
    steps = [*decoder.get("decoders", [decoder]), *pre_tokenizer.get("pretokenizers", [pre_tokenizer])]
    return any(step.get("type") == "ByteLevel" for step in steps)


def _bpe_model(tokenizer_json: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = tokenizer_json["model"]
    model_type = model.get("type", "BPE")
    if model_type != "BPE":
        raise ValueError(
            f"unsupported tokenizer.json model type {model_type!r}; only GPT-2 style byte-level BPE is supported"
        )
    if model.get("byte_fallback"):
        raise ValueError(
            "unsupported tokenizer.json: byte-level BPE with byte_fallback; byte fallback belongs to "
            "SentencePiece-style tokenizers, which have no ByteLevel step"
        )
    for option in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            raise ValueError(f"unsupported tokenizer.json: BPE with {option}={model[option]!r}")
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
