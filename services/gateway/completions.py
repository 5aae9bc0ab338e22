"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from ember_core.tokenizer import Tokenizer
from ember_gateway.engine_client import ServedModel
from ember_gateway.errors import ApiError
from ember_gateway.formats import CompletionFormat, Echo
from ember_gateway.intake import accept
from ember_gateway.choices import build_choices
from ember_gateway.respond import respond
from ember_gateway.schemas import CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions

Prompt = str | list[int]


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrived_at = time.monotonic()
    state, model, body = await accept(request, CompletionRequest)
    prompts = _prompts(body.prompt)
    prompt_ids = [_tokenize(prompt, model.tokenizer) for prompt in prompts]
    choices = build_choices(
        body,
        model,
        prompt_ids,
        max_tokens=DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
        logprobs=body.logprobs,
        prompt_param="prompt",
        # an echoed prompt comes with its tokens' logprobs, as OpenAI's legacy API (and scoring tools) expect
        prompt_logprobs=body.logprobs if body.echo else None,
    )
    echoes = [Echo(_echo_text(prompt, model), ids) if body.echo else None for prompt, ids in zip(prompts, prompt_ids)]
    return await respond(
        request,
        state,
        model,
        CompletionFormat(
            model.tokenizer,
            echoes=[echoes[choice.prompt_index] for choice in choices],
            logprobs=body.logprobs is not None,
            return_token_ids=body.return_token_ids,
        ),
        request_id=f"cmpl-{uuid.uuid4().hex}",
        arrived_at=arrived_at,
        choices=choices,
        stream=bool(body.stream),
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        prompt_tokens=sum(map(len, prompt_ids)),
    )


def _prompts(prompt: str | list[str | int | list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(item, str) for item in prompt):
        return prompt  # type: ignore[return-value]
    if prompt and all(isinstance(item, int) for item in prompt):
        return [prompt]  # type: ignore[list-item]
    if prompt and all(isinstance(item, list) for item in prompt):
        return prompt  # type: ignore[return-value]
    raise ApiError(
        400,
        "prompt must be a non-empty string, list of strings, list of token ids, or list of token-id lists",
        param="prompt",
    )


def _tokenize(prompt: Prompt, tokenizer: Tokenizer | None) -> list[int]:
    if not isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
    return tokenizer.encode_prompt(prompt)


def _echo_text(prompt: Prompt, model: ServedModel) -> str:
    if isinstance(prompt, str):
        return prompt
    return "" if model.tokenizer is None else model.tokenizer.decode(prompt)


