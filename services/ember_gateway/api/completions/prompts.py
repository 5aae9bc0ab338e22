"""Prompts as completions and embeddings take them: a string, strings, token ids, or lists of token
ids, each to token ids."""

from __future__ import annotations

from ember_core.tokenizer import Tokenizer
from ember_gateway.edge.errors import ApiError

Prompt = str | list[int]


def prompt_list(value: str | list[str | int | list[int]], param: str) -> list[Prompt]:
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(item, str) for item in value):
        return value  # type: ignore[return-value]
    if value and all(isinstance(item, int) for item in value):
        return [value]  # type: ignore[list-item]
    if value and all(isinstance(item, list) for item in value):
        return value  # type: ignore[return-value]
    raise ApiError(
        400,
        f"{param} must be a non-empty string, list of strings, list of token ids, or list of token-id lists",
        param=param,
    )


def prompt_ids(prompt: Prompt, tokenizer: Tokenizer | None, param: str) -> list[int]:
    if not isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise ApiError(400, f"this model has no tokenizer: send the {param} as token ids", param=param)
    return tokenizer.encode_prompt(prompt)
