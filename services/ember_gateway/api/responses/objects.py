"""The Responses API's objects (POST /v1/responses) as msgspec Structs, as response_bodies.py has the other
routes' bodies: the Response, its output items, and the typed events of its stream. Each output item
and event carries its `type` as its msgspec tag."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, UnsetType

from ember_gateway.api.request_bodies import Metadata, ResponseText
from ember_gateway.api.response_bodies import Shape

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Shape, tag="output_text", tag_field="type"):
    text: str
    annotations: list[dict[str, Any]]  # none: ember cites nothing
    logprobs: list[dict[str, Any]]  # none: ember does not implement logprobs here


class OutputMessage(Shape, tag="message", tag_field="type"):
    id: str  # msg_...
    role: Literal["assistant"]
    content: list[OutputText]
    status: ItemStatus


class FunctionCall(Shape, tag="function_call", tag_field="type"):
    id: str  # fc_...
    call_id: str  # what the function_call_output answering it names
    name: str
    arguments: str  # JSON text
    status: ItemStatus


OutputItem = OutputMessage | FunctionCall


class FunctionTool(Shape, tag="function", tag_field="type"):
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool


class ToolChoiceFunction(Shape, tag="function", tag_field="type"):
    name: str


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class InputTokensDetails(Shape):
    cached_tokens: int  # 0: the gateway does not learn how much of a prompt an engine had cached
    cache_write_tokens: int


class OutputTokensDetails(Shape):
    reasoning_tokens: int  # 0: ember's models answer without reasoning items


class ResponseUsage(Shape):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(Shape):
    code: Literal["server_error", "rate_limit_exceeded"]  # the codes OpenAI's schema allows here
    message: str


class IncompleteDetails(Shape):
    reason: Literal["max_output_tokens"]


class Response(Shape):
    """A response, and the request settings it ran with (as OpenAI echoes them)."""

    id: str  # resp_...
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None  # stateless
    store: Literal[False]  # stateless
    background: Literal[False]
    temperature: float
    top_p: float
    text: ResponseText
    tool_choice: ToolChoice
    tools: list[FunctionTool]
    truncation: Literal["disabled"]
    metadata: Metadata
    usage: ResponseUsage | UnsetType = UNSET  # left out until the response is done
    user: str | UnsetType = UNSET


class _Lifecycle(Shape):
    response: Response
    sequence_number: int


class ResponseCreated(_Lifecycle, tag="response.created", tag_field="type"):
    pass


class ResponseInProgress(_Lifecycle, tag="response.in_progress", tag_field="type"):
    pass


class ResponseCompleted(_Lifecycle, tag="response.completed", tag_field="type"):
    pass


class ResponseIncomplete(_Lifecycle, tag="response.incomplete", tag_field="type"):
    pass


class ResponseFailed(_Lifecycle, tag="response.failed", tag_field="type"):
    """How a stream that fails after its 200 ends: the response with status failed and its error."""


class OutputItemAdded(Shape, tag="response.output_item.added", tag_field="type"):
    output_index: int
    item: OutputItem
    sequence_number: int


class OutputItemDone(Shape, tag="response.output_item.done", tag_field="type"):
    output_index: int
    item: OutputItem
    sequence_number: int


class ContentPartAdded(Shape, tag="response.content_part.added", tag_field="type"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int


class ContentPartDone(Shape, tag="response.content_part.done", tag_field="type"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int


class OutputTextDelta(Shape, tag="response.output_text.delta", tag_field="type"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]]
    sequence_number: int


class OutputTextDone(Shape, tag="response.output_text.done", tag_field="type"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]]
    sequence_number: int


class FunctionCallArgumentsDelta(Shape, tag="response.function_call_arguments.delta", tag_field="type"):
    """A call's arguments come whole, in one delta, once the call is complete (as chat streams calls)."""

    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class FunctionCallArgumentsDone(Shape, tag="response.function_call_arguments.done", tag_field="type"):
    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int


ResponseEvent = (
    ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete | ResponseFailed | OutputItemAdded
    | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta | OutputTextDone
    | FunctionCallArgumentsDelta | FunctionCallArgumentsDone
)
