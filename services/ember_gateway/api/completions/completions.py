"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from ember_gateway.api.completions.choices import build_choices
from ember_gateway.api.completions.formats import CompletionFormat, Echo
from ember_gateway.api.completions.prompts import Prompt, prompt_ids, prompt_list
from ember_gateway.api.completions.respond import respond
from ember_gateway.api.request_bodies import CompletionRequest
from ember_gateway.edge.intake import accept
from ember_gateway.engines.served_model import ServedModel

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrived_at = time.monotonic()
    state, model, body = await accept(request, CompletionRequest)
    prompts = prompt_list(body.prompt, "prompt")
    token_ids = [prompt_ids(prompt, model.tokenizer, "prompt") for prompt in prompts]
    choices = build_choices(
        body,
        model,
        token_ids,
        max_tokens=DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
        logprobs=body.logprobs,
        prompt_param="prompt",
        # an echoed prompt comes with its tokens' logprobs, as OpenAI's legacy API (and scoring tools) expect
        prompt_logprobs=body.logprobs if body.echo else None,
    )
    echoes = [Echo(_echo_text(prompt, model), ids) if body.echo else None for prompt, ids in zip(prompts, token_ids)]
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
        prompt_tokens=sum(map(len, token_ids)),
    )


def _echo_text(prompt: Prompt, model: ServedModel) -> str:
    if isinstance(prompt, str):
        return prompt
    return "" if model.tokenizer is None else model.tokenizer.decode(prompt)
