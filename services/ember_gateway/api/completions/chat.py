"""POST /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ember_core.output_processor import ChoiceRequest
from ember_gateway.api.completions.choices import build_choices
from ember_gateway.api.completions.formats import ChatFormat
from ember_gateway.api.completions.respond import respond
from ember_gateway.api.completions.tools import ToolPlan, tool_plan, with_tool_description
from ember_gateway.api.completions.tools import constraint as tool_constraint
from ember_gateway.api.request_bodies import ChatCompletionRequest, ChatMessage, RefusalPart, TextPart, TokenizeRequest
from ember_gateway.edge.errors import ApiError
from ember_gateway.edge.intake import accept
from ember_gateway.engines.served_model import ServedModel


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    arrived_at = time.monotonic()
    state, model, body = await accept(request, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    plan = plan_chat(body, model)
    return await respond(
        request,
        state,
        model,
        ChatFormat(model.tokenizer, bool(body.logprobs), body.return_token_ids, plan.tools),
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        arrived_at=arrived_at,
        choices=plan.choices,
        stream=bool(body.stream),
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        prompt_tokens=plan.prompt_tokens,
    )


@dataclass(frozen=True)
class ChatPlan:
    tools: ToolPlan | None  # None: the output is text
    prompt_tokens: int
    choices: list[ChoiceRequest]


def plan_chat(body: ChatCompletionRequest, model: ServedModel) -> ChatPlan:
    """A conversation's tools, prompt and engine requests (chat's, and the Responses API's in chat's form)."""
    tools = tool_plan(body, model.tokenizer.chat_template if model.tokenizer is not None else None)
    prompt_ids = render_prompt(body, model, tools)
    choices = build_choices(
        body,
        model,
        [prompt_ids],
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_param="messages",
        tool_constraint=None if tools is None else tool_constraint(tools),
        keep_special_tokens=tools is not None and tools.reads_control_tokens,
    )
    return ChatPlan(tools, len(prompt_ids), choices)


def render_prompt(
    body: ChatCompletionRequest | TokenizeRequest, model: ServedModel, tools: ToolPlan | None = None
) -> list[int]:
    """The token ids of the messages as the chat template renders them for this model, with the
    tools offered: given to a template that renders them, else described in a system message (in the
    first user message where the template refuses a system role)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so it cannot chat: use /v1/completions with token ids")
    if tokenizer.chat_template is None:
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    template_takes_tools = "tools" in tokenizer.chat_template
    messages = [_message_dict(message, index, template_takes_tools) for index, message in enumerate(body.messages)]
    extra = {}
    if tools is not None and template_takes_tools:
        extra["tools"] = tools.tools
    elif tools is not None:
        messages = with_tool_description(tools, messages, tokenizer.chat_template)
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise ApiError(
                400, "continue_final_message needs add_generation_prompt: false", param="continue_final_message"
            )
        if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
            raise ApiError(400, "continue_final_message needs a last assistant message with content", param="messages")
    try:
        text = tokenizer.render_chat(messages, body.add_generation_prompt, **extra)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    if body.continue_final_message:
        # As vLLM: the rendered text up to the end of the final message's content, so the turn stays open.
        final = messages[-1]["content"]
        end = text.rfind(final)
        if end < 0:
            raise ApiError(400, "the chat template does not render the final message as it is", param="messages")
        text = text[: end + len(final)]
    return tokenizer.encode_prompt(text)


def _message_dict(message: ChatMessage, index: int, template_takes_tools: bool) -> dict[str, Any]:
    content = message.content
    if content is None and message.role not in ("assistant", "function"):  # OpenAI's function content may be null
        raise ApiError(400, f"a {message.role} message needs content", param=f"messages[{index}].content")
    if isinstance(content, list):
        content = "\n".join(_part_text(part, message.role, index) for part in content)
    if message.role == "function" and not message.name:
        raise ApiError(400, "a function message needs the function's name", param=f"messages[{index}].name")
    # As OpenAI: developer messages are the system prompt under newer models' name for it; a
    # function message is the legacy form of a tool result.
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    calls = [_template_call(call, index) for call in message.tool_calls or []]
    if template_takes_tools:
        extra = {"tool_calls": calls or None, "tool_call_id": message.tool_call_id}
    else:  # the turns of a tool call as text, in the syntax describe() asks for
        extra = {}
        content = "\n".join(filter(None, [content, *(_call_text(call) for call in calls)]))
        if role == "tool":
            role, content = "user", f"<tool_response>{content}</tool_response>"
    # null content (an assistant turn that only called tools) renders as empty, not as a template error
    return {"role": role, "content": content or "", "name": message.name, **extra}


def _part_text(part: TextPart | RefusalPart, role: str, index: int) -> str:
    if isinstance(part, TextPart):
        return part.text
    if role != "assistant":
        raise ApiError(400, "a refusal content part is only for assistant messages", param=f"messages[{index}].content")
    return part.refusal


def _template_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """A call as chat templates read it (as vLLM and transformers give it): arguments decoded."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "a tool call is {\"function\": {\"name\", \"arguments\"}}", param=f"messages[{index}].tool_calls")
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments
    return {**call, "type": "function", "function": {"name": function["name"], "arguments": parsed}}


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    return f"<tool_call>{json.dumps({'name': function['name'], 'arguments': function['arguments']})}</tool_call>"
