"""The skeleton completions and chat share: accept a request, run its Generation, and answer with
one JSON body or an SSE stream. The two APIs differ only in their ResponseFormat."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from aiohttp import web

from ember_core.tokenizer import StopRules
from ember_gateway.engine_client import ServedModel
from ember_gateway.errors import ApiError, internal_error
from ember_gateway.generation import ChoicePlan, ChoiceUpdate, Generation
from ember_gateway.schemas import Body, decode_body
from ember_gateway.sse import DONE, open_stream, sse_event
from ember_gateway.state import STATE, GatewayState
from ember_proto import TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class ChoiceResult:
    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, update: ChoiceUpdate) -> None:
        self.text_parts.append(update.text)
        self.token_ids.extend(update.token_ids)
        self.logprobs.extend(update.logprobs)
        self.prompt_logprobs.extend(update.prompt_logprobs)
        self.finish_reason = update.finish_reason


class ResponseFormat(Protocol):
    object_name: str
    chunk_object_name: str

    def stream_start(self, index: int) -> dict[str, Any] | None:
        """The choice of a stream's first chunk for choice index, if the API sends one."""

    def stream_choices(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        """The chunk choices an update becomes (none when it carries nothing to show)."""

    def final_choice(self, result: ChoiceResult) -> dict[str, Any]: ...


# What aiohttp decodes (br and zstd with the Brotli and backports.zstd packages); any other body
# would be read as it is, compressed.
_CONTENT_ENCODINGS = ("identity", "gzip", "deflate", "br", "zstd")


async def accept(request: web.Request, body_type: type[Body]) -> tuple[GatewayState, ServedModel, Body]:
    state = request.app[STATE]
    model = await state.await_model()
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in _CONTENT_ENCODINGS:
        raise ApiError(415, f"unsupported Content-Encoding {encoding!r}: use one of {', '.join(_CONTENT_ENCODINGS)}")
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:  # e.g. a body that is not what its Content-Encoding says
        cause = exc.__cause__ or exc
        raise ApiError(400, f"the request body could not be read: {getattr(cause, 'message', cause)}") from None
    body = decode_body(raw, body_type)
    if body.model != model.name:
        raise ApiError(404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found")
    return state, model, body


async def respond(
    request: web.Request,
    state: GatewayState,
    model: ServedModel,
    response_format: ResponseFormat,
    *,
    request_id: str,
    arrived_at: float,
    plans: list[ChoicePlan],
    stop_rules: StopRules,
    stream: bool,
    include_usage: bool,
    prompt_tokens: int,
) -> web.StreamResponse:
    generation = Generation(
        state.client,
        model,
        state.metrics,
        request_id=request_id,
        arrived_at=arrived_at,
        plans=plans,
        stop_rules=stop_rules,
        timeout=state.config.request_timeout,
        max_pending=state.config.max_pending,
    )
    envelope = _Envelope(request_id, int(time.time()), model.name, prompt_tokens)
    with generation:
        if stream:
            return await _stream(request, generation, response_format, envelope, len(plans), include_usage)
        results = [ChoiceResult(index) for index in range(len(plans))]
        while (update := await generation.next_update()) is not None:
            results[update.index].add(update)
        choices = [response_format.final_choice(result) for result in results]
        return json_response(envelope(response_format.object_name, choices, usage=envelope.usage(generation)))


@dataclass(frozen=True)
class _Envelope:
    """What every body or chunk of one response repeats."""

    request_id: str
    created: int
    model_name: str
    prompt_tokens: int

    def __call__(self, object_name: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            **extra,
        }

    def usage(self, generation: Generation) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": generation.completion_tokens,
            "total_tokens": self.prompt_tokens + generation.completion_tokens,
        }


async def _stream(
    request: web.Request,
    generation: Generation,
    response_format: ResponseFormat,
    envelope: _Envelope,
    num_choices: int,
    include_usage: bool,
) -> web.StreamResponse:
    # Wait for the first output before committing to a 200 stream, so a request the engine
    # rejects still gets its proper status.
    update = await generation.next_update()
    response = await open_stream(request)
    usage_field = {"usage": None} if include_usage else {}

    async def send(choices: list[dict[str, Any]]) -> None:
        await response.write(sse_event(envelope(response_format.chunk_object_name, choices, **usage_field)))

    try:
        for index in range(num_choices):
            if (start := response_format.stream_start(index)) is not None:
                await send([start])
        while update is not None:
            for choice in response_format.stream_choices(update):
                await send([choice])
            update = await generation.next_update()
        if include_usage:
            usage = envelope(response_format.chunk_object_name, [], usage=envelope.usage(generation))
            await response.write(sse_event(usage))
    except ApiError as exc:
        await response.write(sse_event(exc.body()))
    except ConnectionResetError:
        raise
    except Exception:
        logger.exception("stream %s failed", envelope.request_id)
        await response.write(sse_event(internal_error().body()))
    await response.write(DONE)
    return response


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")
