"""Reading HF tokenizer directories: file layouts, special tokens and chat templates from the
config files, and clear errors for tokenizers ember cannot run (SentencePiece-style ones against
transformers: test_tokenizer_sentencepiece.py)."""

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models, pre_tokenizers

from ember_core.tokenizer import load_hf_tokenizer

ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
MERGES = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["Ġthe", "m"], ["e", "m"]]
SPECIALS = ["<s>", "</s>", "<|im_end|>"]


def tokenizer_json(**overrides: Any) -> dict[str, Any]:
    vocab = {special: index for index, special in enumerate(SPECIALS)}
    for token in [*ALPHABET, *("".join(merge) for merge in MERGES)]:
        vocab[token] = len(vocab)
    data: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": vocab[special], "content": special, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for special in SPECIALS
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": MERGES,
        },
    }
    data.update(overrides)
    return data


def write(directory: Path, files: dict[str, Any]) -> Path:
    for name, content in files.items():
        (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


def test_no_tokenizer_files_gives_none(tmp_path: Path) -> None:
    write(tmp_path, {"config.json": {"bos_token_id": 0}})
    assert load_hf_tokenizer(tmp_path) is None


def test_both_merge_forms_match_tokenizers(tmp_path: Path) -> None:
    text = "the theme them them\n <|im_end|> x"
    list_form = tokenizer_json()
    string_form = tokenizer_json()
    string_form["model"] = {**string_form["model"], "merges": [" ".join(merge) for merge in MERGES]}
    expected = HfTokenizer.from_str(json.dumps(list_form)).encode(text, add_special_tokens=False).ids
    for data, directory in [(list_form, tmp_path / "list"), (string_form, tmp_path / "string")]:
        directory.mkdir()
        tokenizer = load_hf_tokenizer(write(directory, {"tokenizer.json": data}))
        assert tokenizer is not None
        assert tokenizer.encode(text, allow_special=True) == expected
    assert len(expected) < len(text.encode())  # the merges did apply


def _set_model(**fields: Any) -> dict[str, Any]:
    data = tokenizer_json()
    data["model"] = {**data["model"], **fields}
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_set_model(type="Unigram"), "model type 'Unigram'; only GPT-2 style byte-level BPE"),
        (_set_model(byte_fallback=True), "byte_fallback"),
        (_set_model(continuing_subword_prefix="##"), "continuing_subword_prefix"),
        (tokenizer_json(normalizer={"type": "Lowercase"}), "normalizer 'Lowercase'"),
        (tokenizer_json(pre_tokenizer={"type": "Metaspace"}), "pre_tokenizer Metaspace; supported"),
        (tokenizer_json(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True}), "add_prefix_space"),
        (
            tokenizer_json(
                pre_tokenizer={
                    "type": "Sequence",
                    "pretokenizers": [
                        {"type": "Split", "pattern": {"Regex": "\\s"}, "behavior": "Removed", "invert": False},
                        {"type": "ByteLevel", "use_regex": False},
                    ],
                }
            ),
            "behavior='Removed'",
        ),
    ],
)
def test_unsupported_tokenizers_are_clear_errors(tmp_path: Path, data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_hf_tokenizer(write(tmp_path, {"tokenizer.json": data}))


def test_special_tokens_and_template_from_tokenizer_config(tmp_path: Path) -> None:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    files = {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": config}
    tokenizer = load_hf_tokenizer(write(tmp_path, files))
    assert tokenizer is not None
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 2)
    assert tokenizer.stop_token_ids == frozenset({2})
    assert tokenizer.chat_template == config["chat_template"]
    assert not tokenizer.add_bos_token


def test_chat_template_file_wins_over_config(tmp_path: Path) -> None:
    config = {"chat_template": [{"name": "default", "template": "config"}, {"name": "tool_use", "template": "tools"}]}
    files = {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": config}
    assert load_hf_tokenizer(write(tmp_path, files)).chat_template == "config"
    assert load_hf_tokenizer(write(tmp_path, {"chat_template.jinja": "file"})).chat_template == "file"


def test_ids_from_config_json_and_stops_from_generation_config(tmp_path: Path) -> None:
    files = {
        "tokenizer.json": tokenizer_json(),
        "config.json": {"bos_token_id": 0, "eos_token_id": [1, 2]},
        "generation_config.json": {"eos_token_id": [1, 2, 7]},
    }
    tokenizer = load_hf_tokenizer(write(tmp_path, files))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.stop_token_ids == frozenset({1, 2, 7})


def test_bos_from_post_processor_is_added_once(tmp_path: Path) -> None:
    post_processor = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}},
            },
        ],
    }
    files = {
        "tokenizer.json": tokenizer_json(post_processor=post_processor),
        "tokenizer_config.json": {"bos_token": "<s>"},
    }
    tokenizer = load_hf_tokenizer(write(tmp_path, files))
    assert tokenizer.add_bos_token
    messages = [{"role": "user", "content": "the theme"}]
    writes_bos = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    omits_bos = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for template in (writes_bos, omits_bos):
        with_template = load_hf_tokenizer(
            write(tmp_path, {"tokenizer_config.json": {"bos_token": "<s>", "chat_template": template}})
        )
        assert with_template.apply_chat_template(messages) == [0, *tokenizer.encode("the theme")]


def test_non_special_added_tokens_are_always_matched(tmp_path: Path) -> None:
    data = tokenizer_json()
    tool_id = len(data["model"]["vocab"])
    data["added_tokens"].append(
        {"id": tool_id, "content": "<tool>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False}
    )
    tokenizer = load_hf_tokenizer(write(tmp_path, {"tokenizer.json": data}))
    assert tokenizer.encode("a<tool>b") == [*tokenizer.encode("a"), tool_id, *tokenizer.encode("b")]
    assert tokenizer.decode([0, tool_id], skip_special_tokens=True) == "<tool>"
    assert HfTokenizer.from_str(json.dumps(data)).encode("a<tool>b").ids == tokenizer.encode("a<tool>b")


def sentencepiece_json(decoder: dict[str, Any] | None) -> dict[str, Any]:
    tokenizer = HfTokenizer(models.BPE({"<unk>": 0, "▁": 1, "a": 2}, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    return {**json.loads(tokenizer.to_str()), "decoder": decoder}


def _replace(pattern: dict[str, str]) -> dict[str, Any]:
    return {"type": "Replace", "pattern": pattern, "content": " "}


def _strip(start: int, stop: int) -> dict[str, Any]:
    return {"type": "Strip", "content": " ", "start": start, "stop": stop}


def _sequence(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Sequence", "decoders": list(steps)}


@pytest.mark.parametrize(
    ("decoder", "message"),
    [
        (None, "without a decoder"),
        ({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}, "decoder Metaspace;"),
        (_sequence({"type": "ByteFallback"}, _replace({"String": "▁"})), r"Sequence\[ByteFallback, Replace\]"),
        (_sequence(_replace({"String": "▁"}), _strip(1, 0)), r"Sequence\[Replace, Strip\]"),
        (_sequence(_replace({"String": "▁"}), {"type": "Fuse"}, _strip(0, 1)), "only leading spaces"),
        (_sequence(_replace({"Regex": "▁+"})), "Replace with pattern"),
    ],
)
def test_unsupported_sentencepiece_decoders_are_clear_errors(
    tmp_path: Path, decoder: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_hf_tokenizer(write(tmp_path, {"tokenizer.json": sentencepiece_json(decoder)}))
