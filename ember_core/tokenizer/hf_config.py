"""What the JSON files of a Hugging Face model directory say around its vocabulary: special tokens,
BOS / EOS, stop tokens, whether prompts start with BOS, and the chat template."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_SPECIAL_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")


@dataclass(frozen=True)
class HfTokenizerConfig:
    tokenizer_config: dict[str, Any]  # tokenizer_config.json
    special_tokens_map: dict[str, Any]  # special_tokens_map.json
    model_config: dict[str, Any]  # config.json
    generation_config: dict[str, Any]  # generation_config.json
    chat_template: str | None

    @classmethod
    def read(cls, model_dir: Path) -> HfTokenizerConfig:
        tokenizer_config = read_json(model_dir / "tokenizer_config.json")
        return cls(
            tokenizer_config=tokenizer_config,
            special_tokens_map=read_json(model_dir / "special_tokens_map.json"),
            model_config=read_json(model_dir / "config.json"),
            generation_config=read_json(model_dir / "generation_config.json"),
            chat_template=_chat_template(model_dir, tokenizer_config),
        )

    def added_tokens_decoder(self) -> dict[int, dict[str, Any]]:
        """tokenizer_config.json's added tokens by id, as serialized AddedToken dicts."""
        entries = self.tokenizer_config.get("added_tokens_decoder", {})
        return {int(token_id): entry for token_id, entry in entries.items()}

    def named_special_token_texts(self) -> list[str]:
        """The tokens the config files name bos_token, eos_token, ..., mask_token."""
        texts = [_token_text(source.get(name)) for source in self._sources() for name in _NAMED_SPECIAL_TOKENS]
        return [text for text in texts if text]

    def listed_special_token_texts(self) -> list[str]:
        """The tokens the config files list as additional_special_tokens / extra_special_tokens."""
        texts = []
        for source in self._sources():
            for name in _SPECIAL_TOKEN_LISTS:
                listed = source.get(name) or []
                texts += [_token_text(value) for value in (listed.values() if isinstance(listed, dict) else listed)]
        return [text for text in texts if text]

    def _sources(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.special_tokens_map, self.tokenizer_config

    def token_text(self, name: str) -> str | None:
        """The text of a named special token ("bos_token", ...), if the config files name one."""
        return _token_text(self.tokenizer_config.get(name)) or _token_text(self.special_tokens_map.get(name))

    def bos_and_eos_ids(self, token_id_of: Callable[[str], int | None]) -> tuple[int | None, int | None]:
        """BOS and EOS by the tokens the config files name, else by config.json's ids."""
        ids = []
        for name in ("bos_token", "eos_token"):
            text = self.token_text(name)
            token_id = token_id_of(text) if text is not None else None
            ids.append(token_id if token_id is not None else _first_id(self.model_config.get(f"{name}_id")))
        return ids[0], ids[1]

    def extra_stop_ids(self) -> list[int]:
        return [*_ids(self.model_config.get("eos_token_id")), *_ids(self.generation_config.get("eos_token_id"))]

    def adds_bos(self, tokenizer_json: dict[str, Any] | None) -> bool:
        """Whether a prompt starts with BOS. As in transformers, tokenizer.json's post-processor
        decides when there is a tokenizer.json (add_bos_token in tokenizer_config.json is then
        ignored); otherwise add_bos_token. tokenizer_json: the parsed file, None without one."""
        if tokenizer_json is None:
            return bool(self.tokenizer_config.get("add_bos_token", False))
        post_processor = tokenizer_json.get("post_processor")
        return post_processor is not None and _post_processor_adds(post_processor, self.token_text("bos_token"))


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        return json.load(file)


def _token_text(value: str | dict[str, Any] | None) -> str | None:
    """Special tokens are saved as plain strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


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
