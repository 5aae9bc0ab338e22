"""A Responses API request in chat's form, so that it runs through chat's pieces (chat template,
tools, output constraints): `instructions` becomes a developer message, `input` items become chat
messages (a `function_call` joins the assistant turn before it as one of its tool_calls, a
`function_call_output` is a tool message), function tools and `tool_choice` take chat's nesting, and
`text.format` becomes `response_format`.

ember keeps no state between requests (state would pin a client to one gateway), so what needs it
is refused with a 400 saying to send the conversation as input items: `store: true`,
`previous_response_id`, `conversation`, `background: true`, and `item_reference` items. An absent
`store` is taken as false (OpenAI's default is true, but the SDK does not send it)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ember_gateway.api.request_bodies import (
    ChatCompletionRequest,
    ChatMessage,
    JsonObjectFormat,
    JsonSchemaFormat,
    RefusalPart,
    ResponsesRequest,
    ResponseText,
    TextPart,
    validation_error,
)
from ember_gateway.api.responses.objects import FunctionTool, ToolChoice, ToolChoiceFunction
from ember_gateway.edge.errors import ApiError

_STATELESS = "ember keeps no responses: send the whole conversation as input items"


class _InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    text: str


class _OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    """An earlier output message's text, sent back (its annotations and logprobs are not read)."""

    text: str


class _Refusal(msgspec.Struct, tag="refusal", tag_field="type"):
    refusal: str


class _Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_InputText | _OutputText | _Refusal]


class _FunctionCall(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutput(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[_InputText]


_ITEMS: dict[str, type[_Message | _FunctionCall | _FunctionCallOutput]] = {
    "message": _Message,
    "function_call": _FunctionCall,
    "function_call_output": _FunctionCallOutput,
}
_NOT_READ = {  # content parts and items ember's text models cannot take, and why
    "input_image": "ember's models read text only",
    "input_file": "ember's models read text only",
    "input_audio": "ember's models read text only",
    "reasoning": "ember's models do not reason in items: leave reasoning items out",
    "item_reference": _STATELESS,
}


def chat_request(body: ResponsesRequest, tools: list[FunctionTool], tool_choice: ToolChoice) -> ChatCompletionRequest:
    """body, with its tools_of and tool_choice_of, as the chat completion it asks for; a 400 naming
    the field for what ember does not do."""
    _reject_unsupported(body)
    instructions = [ChatMessage(role="developer", content=body.instructions)] if body.instructions is not None else []
    if tool_choice not in ("none", "auto") and not tools:
        raise ApiError(400, "tool_choice asks for a call, but no tools are given", param="tool_choice")
    return ChatCompletionRequest(
        model=body.model,
        messages=instructions + _messages(body.input),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        priority=body.priority,
        stream=body.stream,
        tools=[_chat_tool(tool) for tool in tools] or None,
        tool_choice=_chat_tool_choice(tool_choice) if tools else None,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
    )


def tools_of(body: ResponsesRequest) -> list[FunctionTool]:
    """The request's function tools, as a Response echoes them."""
    return [_tool(tool, index) for index, tool in enumerate(body.tools or [])]


def tool_choice_of(body: ResponsesRequest) -> ToolChoice:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice  # type: ignore[return-value]
    if isinstance(choice, dict) and choice.get("type") == "function":
        try:
            return msgspec.convert(choice, ToolChoiceFunction)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, "tool_choice") from None
    raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}: '
                        "ember implements function tools only", param="tool_choice")


def _reject_unsupported(body: ResponsesRequest) -> None:
    for name, value in (("store", body.store), ("previous_response_id", body.previous_response_id),
                        ("conversation", body.conversation), ("background", body.background)):
        if value not in (None, False):
            raise ApiError(400, f"{name}: {_STATELESS}", param=name)
    if body.reasoning:
        raise ApiError(400, "ember's models do not take reasoning settings: leave reasoning out", param="reasoning")
    if body.include:
        raise ApiError(400, "ember includes no extra output data: leave include out", param="include")
    if body.top_logprobs:
        raise ApiError(400, "ember does not implement logprobs in responses: use chat completions",
                       param="top_logprobs")
    if body.truncation == "auto":
        raise ApiError(400, "ember does not truncate input: send truncation \"disabled\" or leave it out",
                       param="truncation")


def _messages(input_: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(input_, str):
        return [ChatMessage(role="user", content=input_)]
    messages: list[ChatMessage] = []
    for index, raw in enumerate(input_):
        item = _item(raw, f"input[{index}]")
        if isinstance(item, _Message):
            messages.append(ChatMessage(role=item.role, content=_content(item.content)))
        elif isinstance(item, _FunctionCall):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the same turn: its text, then its calls
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            output = item.output if isinstance(item.output, str) else "".join(part.text for part in item.output)
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
    return messages


def _item(raw: dict[str, Any], param: str) -> _Message | _FunctionCall | _FunctionCallOutput:
    kind = raw.get("type", "message")  # a message may leave its type out
    parts = raw.get("content") if kind == "message" and isinstance(raw.get("content"), list) else []
    for part_index, part in enumerate(parts):
        part_kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part_kind, str) and part_kind in _NOT_READ:
            raise ApiError(400, f"{part_kind}: {_NOT_READ[part_kind]}", param=f"{param}.content[{part_index}].type")
    if isinstance(kind, str) and kind in _NOT_READ:
        raise ApiError(400, f"{kind} items: {_NOT_READ[kind]}", param=f"{param}.type")
    if not isinstance(kind, str) or kind not in _ITEMS:
        raise ApiError(400, f"an input item is a message, function_call or function_call_output, not {kind!r}",
                       param=f"{param}.type")
    try:
        return msgspec.convert(raw, _ITEMS[kind])
    except msgspec.ValidationError as exc:
        raise validation_error(exc, param) from None


def _content(content: str | list[_InputText | _OutputText | _Refusal]) -> str | list[TextPart | RefusalPart]:
    if isinstance(content, str):
        return content
    return [RefusalPart(part.refusal) if isinstance(part, _Refusal) else TextPart(part.text) for part in content]


def _tool(tool: dict[str, Any], index: int) -> FunctionTool:
    if tool.get("type") != "function":
        raise ApiError(400, f"ember implements function tools only, not {tool.get('type')!r} (OpenAI's built-in "
                            "tools run on OpenAI's side)", param=f"tools[{index}].type")
    # OpenAI's Responses API makes a function strict unless it says otherwise
    fields = {"description": None, "parameters": None, **tool, "strict": tool.get("strict") is not False}
    known = {key: value for key, value in fields.items() if key in ("type", *FunctionTool.__struct_fields__)}
    try:
        return msgspec.convert(known, FunctionTool)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, f"tools[{index}]") from None


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}, "strict": tool.strict}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(text: ResponseText) -> dict[str, Any] | None:
    format_ = text.format
    if isinstance(format_, JsonObjectFormat):
        return {"type": "json_object"}
    if isinstance(format_, JsonSchemaFormat):
        return {"type": "json_schema",
                "json_schema": {"name": format_.name, "schema": format_.schema, "strict": format_.strict}}
    return None
