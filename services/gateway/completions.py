"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ember_core.tokenizer import Tokenizer
from ember_gateway.engine_client import ServedModel
from ember_gateway.errors import ApiError
from ember_gateway.generation import ChoiceUpdate
from ember_gateway.logprobs import TextOffsets, completion_logprobs, echoed_prompt_logprobs
from ember_gateway.plans import build_plans, stop_rules
from ember_gateway.respond import ChoiceResult, accept, respond
from ember_gateway.schemas import CompletionRequest
from ember_proto import TokenLogprob

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions

Prompt = str | list[int]


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrived_at = time.monotonic()
    state, model, body = await accept(request, CompletionRequest)
    prompts = _prompts(body.prompt)
    prompt_ids = [_tokenize(prompt, model.tokenizer) for prompt in prompts]
    plans = build_plans(
        body,
        model,
        prompt_ids,
        max_tokens=DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
        logprobs=body.logprobs,
        prompt_param="prompt",
        # an echoed prompt comes with its tokens' logprobs, as OpenAI's legacy API (and scoring tools) expect
        prompt_logprobs=body.logprobs if body.echo else None,
    )
    n = body.n or 1
    echoes = [Echo(_echo_text(prompt, model), ids) if body.echo else None for prompt, ids in zip(prompts, prompt_ids)]
    return await respond(
        request,
        state,
        model,
        CompletionFormat(
            model.tokenizer,
            echoes=[echo for echo in echoes for _ in range(n)],
            logprobs=body.logprobs is not None,
            return_token_ids=body.return_token_ids,
        ),
        request_id=f"cmpl-{uuid.uuid4().hex}",
        arrived_at=arrived_at,
        plans=plans,
        stop_rules=stop_rules(body, model),
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


@dataclass(frozen=True)
class Echo:
    text: str
    prompt_ids: list[int]


class CompletionFormat:
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self, tokenizer: Tokenizer | None, echoes: list[Echo | None], logprobs: bool, return_token_ids: bool
    ) -> None:
        """echoes: per choice, the prompt to echo before its text, or None."""
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._return_token_ids = return_token_ids
        self._echoes = echoes
        self._unsent_echoes = list(echoes)  # a stream sends a choice's echo with its first chunk
        self._offsets = [TextOffsets(tokenizer, len(echo.text) if echo else 0) for echo in echoes]

    def stream_start(self, index: int) -> dict[str, Any] | None:
        return None

    def stream_choices(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        index = update.index
        echo = self._unsent_echoes[index]
        if echo is None and not (update.finish_reason or update.has_content(self._logprobs, self._return_token_ids)):
            return []
        self._unsent_echoes[index] = None
        return [
            self._choice(
                index, update.text, update.logprobs, update.token_ids, update.finish_reason, echo, update.prompt_logprobs
            )
        ]

    def final_choice(self, result: ChoiceResult) -> dict[str, Any]:
        return self._choice(
            result.index,
            result.text,
            result.logprobs,
            result.token_ids,
            result.finish_reason,
            self._echoes[result.index],
            result.prompt_logprobs,
        )

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob],
        token_ids: list[int],
        finish_reason: str | None,
        echo: Echo | None,
        prompt_logprobs: list[TokenLogprob],
    ) -> dict[str, Any]:
        """echo: the prompt to put before text (a stream's first chunk, a whole response)."""
        choice: dict[str, Any] = {
            "index": index,
            "text": (echo.text if echo else "") + text,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if self._logprobs:
            entries = completion_logprobs(self._tokenizer, logprobs, self._offsets[index])
            if echo is not None:
                prompt = echoed_prompt_logprobs(self._tokenizer, echo.prompt_ids, prompt_logprobs)
                entries = {key: prompt[key] + entries[key] for key in entries}
            choice["logprobs"] = entries
        if self._return_token_ids:
            choice["token_ids"] = token_ids
        return choice
