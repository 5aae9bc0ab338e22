"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from ember_gateway.engine_client import ServedModel
from ember_gateway.errors import ApiError
from ember_gateway.formats import ChatFormat
from ember_gateway.intake import accept
from ember_gateway.plans import build_choices
from ember_gateway.respond import respond
from ember_gateway.schemas import ChatCompletionRequest, ChatMessage


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    arrived_at = time.monotonic()
    state, model, body = await accept(request, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    prompt_ids = _render_prompt(body, model)
    choices = build_choices(
        body,
        model,
        [prompt_ids],
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_param="messages",
    )
    return await respond(
        request,
        state,
        model,
        ChatFormat(model.tokenizer, bool(body.logprobs), body.return_token_ids),
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        arrived_at=arrived_at,
        choices=choices,
        stream=bool(body.stream),
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        prompt_tokens=len(prompt_ids),
    )


def _render_prompt(body: ChatCompletionRequest, model: ServedModel) -> list[int]:
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so it cannot chat: use /v1/completions with token ids")
    if tokenizer.chat_template is None:
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    messages = [_message_dict(message, index) for index, message in enumerate(body.messages)]
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise ApiError(
                400, "continue_final_message needs add_generation_prompt: false", param="continue_final_message"
            )
        if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
            raise ApiError(400, "continue_final_message needs a last assistant message with content", param="messages")
    try:
        text = tokenizer.render_chat(messages, body.add_generation_prompt)
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


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    content = message.content
    if content is None and message.role != "assistant":
        raise ApiError(400, f"a {message.role} message needs content", param=f"messages[{index}].content")
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    # As OpenAI: developer messages are the system prompt under newer models' name for it.
    role = "system" if message.role == "developer" else message.role
    # null content (an assistant turn that only called tools) renders as empty, not as a template error
    return {"role": role, "content": content or "", "name": message.name}


