"""The steps after the plan, which completions and chat share: submit the choices (a Generation),
take their updates, shape them as the API's bodies or chunks (its ApiShape, formats.py), and answer
with one JSON body or an SSE stream. The Responses API (api/responses/) shapes its own events, on
the same generation, JSON answer and stream opening."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from msgspec import UNSET, UnsetType

from ember_core.output_processor import ChoiceRequest, ChoiceResult, ChoiceUpdate
from ember_gateway.api.completions.formats import ApiShape
from ember_gateway.api.response_bodies import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, Usage
from ember_gateway.edge.connections import client_half_closed
from ember_gateway.edge.errors import ApiError, internal_error
from ember_gateway.edge.sse import DONE, open_stream, sse_event
from ember_gateway.engines.generation import Generation
from ember_gateway.engines.served_model import ServedModel
from ember_gateway.state import STATE, GatewayState

logger = logging.getLogger(__name__)

_HEARTBEAT_S = 0.5
_Enveloped = TypeVar("_Enveloped", ChatCompletion, Completion, ChatCompletionChunk, CompletionChunk)


async def respond(
    request: web.Request,
    state: GatewayState,
    model: ServedModel,
    api_shape: ApiShape,
    *,
    request_id: str,
    arrived_at: float,
    choices: list[ChoiceRequest],
    stream: bool,
    include_usage: bool,
    prompt_tokens: int,
) -> web.StreamResponse:
    generation = start_generation(state, model, request_id=request_id, arrived_at=arrived_at, choices=choices)
    envelope = _Envelope(request_id, int(time.time()), model.name, prompt_tokens)
    with generation:
        if stream:
            return await _stream(request, generation, api_shape, envelope, len(choices), include_usage)
        return await answer_json(request, _answer(generation, api_shape, envelope, len(choices)))


def start_generation(
    state: GatewayState, model: ServedModel, *, request_id: str, arrived_at: float, choices: list[ChoiceRequest]
) -> Generation:
    """The engine requests of choices, under the gateway's timeout and limit (submitted on entering it)."""
    return Generation(
        state.pool,
        model,
        state.metrics,
        request_id=request_id,
        arrived_at=arrived_at,
        choices=choices,
        timeout=state.config.request_timeout,
        max_pending=state.config.max_pending,
    )


async def answer_json(request: web.Request, answer: Coroutine[Any, Any, Any]) -> web.StreamResponse:
    """The body answer computes, as one JSON response (an ApiError: its status and error body)."""
    pending = asyncio.ensure_future(answer)
    try:
        response = await _await_or_heartbeat(request, pending, lambda: _open_json(request), b" ")
    finally:
        pending.cancel()
    if response is None:
        return json_response(pending.result())
    try:
        body = pending.result()
    except ApiError as exc:  # the 200 is sent: the error is the body
        request.app[STATE].metrics.count_error(exc.status)
        body = exc.body()
    await response.write(msgspec.json.encode(body))
    await response.write_eof()
    return response


async def open_event_stream(
    request: web.Request, generation: Generation
) -> tuple[web.StreamResponse, asyncio.Future[ChoiceUpdate | None]]:
    """The 200 stream and the generation's first update, whose result() raises what the engine said.
    The first output is awaited before committing to a 200, so a request the engine rejects still
    gets its proper status (unless the client shut its side meanwhile: its error is then the
    stream's to send)."""
    first = asyncio.ensure_future(generation.next_update())
    try:
        response = await _await_or_heartbeat(request, first, lambda: open_stream(request), b": waiting\n\n")
    finally:
        first.cancel()
    if response is None:
        first.result()  # an engine's refusal: raised as its HTTP status
        response = await open_stream(request)
    return response, first


async def _answer(
    generation: Generation, api_shape: ApiShape, envelope: _Envelope, num_choices: int
) -> ChatCompletion | Completion:
    results = [ChoiceResult(index) for index in range(num_choices)]
    while (update := await generation.next_update()) is not None:
        results[update.index].add(update)
    body_choices = [api_shape.final_choice(result) for result in results]
    return envelope(api_shape.body_type, api_shape.object_name, body_choices, envelope.usage(generation))


async def _await_or_heartbeat(
    request: web.Request,
    pending: asyncio.Future[Any],
    open_response: Callable[[], Awaitable[web.StreamResponse]],
    heartbeat: bytes,
) -> web.StreamResponse | None:
    """Wait for pending; None if it is done before the client shuts its side of the connection.
    After that, the client may still be reading (a half-close) or be gone (a close), which look the
    same until something is written. So the response is opened (a 200) and the heartbeat written
    every half second until pending is done: a gone client answers the first write with a reset,
    the next write fails, and the request is aborted as on any disconnect."""
    half_closed = asyncio.ensure_future(client_half_closed(request).wait())
    try:
        await asyncio.wait({pending, half_closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        half_closed.cancel()
    if pending.done():
        return None
    response = await open_response()
    while not pending.done():
        await response.write(heartbeat)
        await asyncio.wait({pending}, timeout=_HEARTBEAT_S)
    return response


async def _open_json(request: web.Request) -> web.StreamResponse:
    """A JSON body of unknown length, sent in chunks."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    return response


@dataclass(frozen=True)
class _Envelope:
    """What every body or chunk of one response repeats."""

    request_id: str
    created: int
    model_name: str
    prompt_tokens: int

    def __call__(
        self, shape: type[_Enveloped], object_name: str, choices: list[Any], usage: Usage | None | UnsetType
    ) -> _Enveloped:
        return shape(
            id=self.request_id,
            object=object_name,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
        )

    def usage(self, generation: Generation) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=generation.completion_tokens,
            total_tokens=self.prompt_tokens + generation.completion_tokens,
        )


async def _stream(
    request: web.Request,
    generation: Generation,
    api_shape: ApiShape,
    envelope: _Envelope,
    num_choices: int,
    include_usage: bool,
) -> web.StreamResponse:
    response, first = await open_event_stream(request, generation)
    # include_usage: null on every chunk, then a last chunk with the usage (as OpenAI streams)
    chunk_usage = None if include_usage else UNSET

    async def send(choices: list[Any], usage: Usage | None | UnsetType = chunk_usage) -> None:
        chunk = envelope(api_shape.chunk_type, api_shape.chunk_object_name, choices, usage)
        await response.write(sse_event(chunk))

    try:
        update = first.result()
        for index in range(num_choices):
            if (start := api_shape.stream_start(index)) is not None:
                await send([start])
        while update is not None:
            for choice in api_shape.stream_choices(update):
                await send([choice])
            update = await generation.next_update()
        if include_usage:
            await send([], envelope.usage(generation))
    except ApiError as exc:
        request.app[STATE].metrics.count_error(exc.status)
        await response.write(sse_event(exc.body()))
    except ConnectionResetError:
        raise
    except Exception:
        logger.exception("stream %s failed", envelope.request_id)
        request.app[STATE].metrics.count_error(500)
        await response.write(sse_event(internal_error().body()))
    await response.write(DONE)
    return response


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")
