"""Generated text as the Responses API's objects: output items (a message, function calls) and the
Response that carries them with the request's settings."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from msgspec import UNSET, UnsetType

from ember_gateway.api.completions.tools import ToolPlan, parse_calls
from ember_gateway.api.request_bodies import ResponsesRequest
from ember_gateway.api.responses.objects import (
    FunctionCall,
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    Response,
    ResponseError,
    ResponseUsage,
    ToolChoice,
)

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def output_items(tools: ToolPlan | None, text: str, status: ItemStatus) -> list[OutputItem]:
    """A whole output's items: its message (when it has text, or nothing else), then its calls."""
    content, calls = (text, []) if tools is None else parse_calls(tools, text)
    message = [message_item(content or "", status)] if content or not calls else []
    return [*message, *(function_call_item(call, "completed") for call in calls)]


def message_item(text: str, status: ItemStatus, item_id: str | None = None) -> OutputMessage:
    """item_id: the message's, as an earlier event of the stream gave it; None: a new one."""
    item_id = item_id or f"msg_{uuid.uuid4().hex}"
    return OutputMessage(id=item_id, role="assistant", content=[output_text(text)], status=status)


def output_text(text: str) -> OutputText:
    return OutputText(text=text, annotations=[], logprobs=[])


def function_call_item(call: dict[str, Any], status: ItemStatus) -> FunctionCall:
    """call: one of tools.py's calls, in chat's form."""
    function = call["function"]
    return FunctionCall(
        id=f"fc_{uuid.uuid4().hex}", call_id=call["id"], name=function["name"], arguments=function["arguments"],
        status=status,
    )


def usage(input_tokens: int, output_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=input_tokens + output_tokens,
    )


@dataclass(frozen=True)
class ResponseEcho:
    """What every Response object of one request repeats: its id, model and the request's settings."""

    id: str
    created_at: int
    model: str
    body: ResponsesRequest
    tools: list[FunctionTool]
    tool_choice: ToolChoice

    def __call__(
        self,
        status: Status,
        output: Sequence[OutputItem] = (),
        usage: ResponseUsage | UnsetType = UNSET,
        error: ResponseError | None = None,
    ) -> Response:
        body = self.body
        return Response(
            id=self.id,
            object="response",
            created_at=self.created_at,
            status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=list(output),
            parallel_tool_calls=body.parallel_tool_calls,
            previous_response_id=None,
            store=False,
            background=False,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            text=body.text,
            tool_choice=self.tool_choice,
            tools=self.tools,
            truncation="disabled",
            metadata=body.metadata or {},
            user=body.user,
            usage=usage,
        )
