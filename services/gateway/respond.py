"""The steps after the plan, which completions and chat share: submit the choices (a Generation),
take their updates, shape them with the API's ResponseFormat, and answer with one JSON body or an
SSE stream."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from ember_core.output_processor import ChoiceRequest, ChoiceResult
from ember_gateway.engine_client import ServedModel
from ember_gateway.errors import ApiError, internal_error
from ember_gateway.formats import ResponseFormat
from ember_gateway.generation import Generation
from ember_gateway.sse import DONE, open_stream, sse_event
from ember_gateway.state import GatewayState

logger = logging.getLogger(__name__)


async def respond(
    request: web.Request,
    state: GatewayState,
    model: ServedModel,
    response_format: ResponseFormat,
    *,
    request_id: str,
    arrived_at: float,
    choices: list[ChoiceRequest],
    stream: bool,
    include_usage: bool,
    prompt_tokens: int,
) -> web.StreamResponse:
    generation = Generation(
        state.pool,
        model,
        state.metrics,
        request_id=request_id,
        arrived_at=arrived_at,
        choices=choices,
        timeout=state.config.request_timeout,
        max_pending=state.config.max_pending,
    )
    envelope = _Envelope(request_id, int(time.time()), model.name, prompt_tokens)
    with generation:
        if stream:
            return await _stream(request, generation, response_format, envelope, len(choices), include_usage)
        results = [ChoiceResult(index) for index in range(len(choices))]
        while (update := await generation.next_update()) is not None:
            results[update.index].add(update)
        body_choices = [response_format.final_choice(result) for result in results]
        return json_response(envelope(response_format.object_name, body_choices, usage=envelope.usage(generation)))


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
