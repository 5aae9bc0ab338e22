"""POST /v1/responses: OpenAI's Responses API, stateless. The request runs as the chat completion it
asks for (input.py) and its output is shaped as a Response (output.py), or
streamed as typed events (stream.py)."""

from __future__ import annotations

import logging
import time
import uuid

from aiohttp import web

from ember_core.output_processor import ChoiceResult
from ember_gateway.api.completions.chat import ChatPlan, plan_chat
from ember_gateway.api.completions.respond import answer_json, open_event_stream, start_generation
from ember_gateway.api.request_bodies import ResponsesRequest
from ember_gateway.api.responses.input import chat_request, tool_choice_of, tools_of
from ember_gateway.api.responses.objects import FunctionTool, Response, ResponseEvent, ToolChoice
from ember_gateway.api.responses.output import ResponseEcho, output_items, usage
from ember_gateway.api.responses.stream import ResponseEvents
from ember_gateway.edge.errors import ApiError, internal_error
from ember_gateway.edge.intake import accept
from ember_gateway.edge.sse import sse_event
from ember_gateway.engines.generation import Generation
from ember_gateway.engines.served_model import ServedModel
from ember_gateway.state import STATE
from ember_proto import FinishReason

logger = logging.getLogger(__name__)

# chat's fields that errors of the chat pieces name, and the Responses fields they came from
_CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


async def create_response(request: web.Request) -> web.StreamResponse:
    arrived_at = time.monotonic()
    state, model, body = await accept(request, ResponsesRequest)
    tools, tool_choice = tools_of(body), tool_choice_of(body)
    plan = _plan(body, model, tools, tool_choice)
    echo = ResponseEcho(f"resp_{uuid.uuid4().hex}", int(time.time()), model.name, body, tools, tool_choice)
    generation = start_generation(state, model, request_id=echo.id, arrived_at=arrived_at, choices=plan.choices)
    with generation:
        if body.stream:
            return await _stream(request, generation, echo, plan)
        return await answer_json(request, _answer(generation, echo, plan))


def _plan(body: ResponsesRequest, model: ServedModel, tools: list[FunctionTool], tool_choice: ToolChoice) -> ChatPlan:
    """The chat plan of body, its errors naming the Responses API's fields."""
    try:
        return plan_chat(chat_request(body, tools, tool_choice), model)
    except ApiError as exc:
        exc.param = _responses_param(exc.param)
        raise


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    name = param.split(".")[0].split("[")[0]
    return _CHAT_PARAMS.get(name, param)


async def _answer(generation: Generation, echo: ResponseEcho, plan: ChatPlan) -> Response:
    result = ChoiceResult(0)
    while (update := await generation.next_update()) is not None:
        result.add(update)
    status = "incomplete" if result.finish_reason is FinishReason.LENGTH else "completed"
    output = output_items(plan.tools, result.text, status)
    return echo(status, output, usage(plan.prompt_tokens, generation.completion_tokens))


async def _stream(
    request: web.Request, generation: Generation, echo: ResponseEcho, plan: ChatPlan
) -> web.StreamResponse:
    response, first = await open_event_stream(request, generation)
    events = ResponseEvents(echo, plan.tools)

    async def send(batch: list[ResponseEvent]) -> None:
        for event in batch:
            await response.write(sse_event(event, name=type(event).__struct_config__.tag))

    await send(events.start())
    try:
        update, finish_reason = first.result(), None
        while update is not None:
            finish_reason = update.finish_reason or finish_reason
            await send(events.update(update))
            update = await generation.next_update()
        used = usage(plan.prompt_tokens, generation.completion_tokens)
        await send(events.finish(finish_reason is FinishReason.LENGTH, used))
    except ApiError as exc:
        request.app[STATE].metrics.count_error(exc.status)
        await send(events.failed(exc))
    except ConnectionResetError:
        raise
    except Exception:
        logger.exception("stream %s failed", echo.id)
        request.app[STATE].metrics.count_error(500)
        await send(events.failed(internal_error()))
    return response
