"""GET /openapi.json: an OpenAPI 3.1 description of the gateway. Request bodies are the msgspec
Structs that decode them (schemas.py), so the document cannot drift from validation; the response
Structs below describe what formats.py, respond.py, tokenize.py and app.py send, which
tests/gateway/test_openapi.py checks against real responses."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any, Literal

import msgspec
from aiohttp import web
from msgspec import UNSET, UnsetType

from ember_gateway.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

_REF = "#/components/schemas/{name}"
FinishLabel = Literal["stop", "length", "tool_calls"]


class _Shape(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A response object: exactly these fields (additionalProperties false), so a field the gateway
    adds without describing it here fails tests/gateway/test_openapi.py."""


class ErrorDetail(_Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Shape):
    """Every 4xx and 5xx body, as OpenAI's; a stream that fails after its 200 sends it as an event."""

    error: ErrorDetail


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Shape):
    token: str
    logprob: float
    bytes: list[int] | None  # null without a tokenizer


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class FunctionCall(_Shape):
    name: str
    arguments: str  # JSON text


class ToolCall(_Shape):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ToolCallChunk(ToolCall):
    """A stream sends each call whole, once complete."""

    index: int


class ChatCompletionMessage(_Shape):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatCompletionChoice(_Shape):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishLabel
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids


class ChatCompletion(_Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatCompletionDelta(_Shape):
    role: Literal["assistant"] | UnsetType = UNSET  # the first chunk of each choice
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET


class ChatCompletionChunkChoice(_Shape):
    index: int
    delta: ChatCompletionDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishLabel | None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(_Shape):
    """One `data:` event of a chat stream; with stream_options.include_usage every chunk has usage
    null, and a last chunk with no choices has the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class CompletionLogprobs(_Shape):
    """An echoed prompt's first token has null logprobs: nothing precedes it."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] | UnsetType = UNSET


class Completion(_Shape):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | UnsetType = UNSET


class CompletionChunk(_Shape):
    """One `data:` event of a completions stream; usage as in ChatCompletionChunk."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class Model(_Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Shape):
    object: Literal["list"]
    data: list[Model]


class Health(_Shape):
    """model and engine_id: the first engine taking requests; models and engines: all of them."""

    status: Literal["ok"]
    model: str
    engine_id: str
    models: list[str]
    engines: list[str]


class TokenizeResponse(_Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None  # with return_token_strs


class DetokenizeResponse(_Shape):
    prompt: str


_STRUCTS = (
    ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ErrorResponse, ChatCompletion,
    ChatCompletionChunk, Completion, CompletionChunk, Model, ModelList, Health, TokenizeResponse, DetokenizeResponse,
)
_ERRORS = {"4XX": {"$ref": "#/components/responses/Error"}, "5XX": {"$ref": "#/components/responses/Error"}}


def _ref(struct: type[msgspec.Struct]) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}


def _json(struct: type[msgspec.Struct], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(struct)}}}


def _event(chunk: type[msgspec.Struct]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 has `schema` describe each event of a stream): a chunk,
    or the error that ends a stream failing after its 200, or the final `[DONE]`."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}}}


def _post(
    summary: str, body: type[msgspec.Struct], answer: type[msgspec.Struct], chunk: type[msgspec.Struct] | None = None
) -> dict[str, Any]:
    ok = _json(answer, "The result")
    if chunk is not None:
        ok["description"] = f"The result; with stream: true, server-sent events of {chunk.__name__}, then `data: [DONE]`"
        ok["content"]["text/event-stream"] = {"schema": _event(chunk)}
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
        "responses": {"200": ok, **_ERRORS},
    }


def _get(summary: str, answer: dict[str, Any], open_path: bool = False, **extra: Any) -> dict[str, Any]:
    operation = {"summary": summary, **extra, "responses": {"200": answer, **_ERRORS}}
    if open_path:
        operation["security"] = []  # app.py's _OPEN_PATHS
    return {"get": operation}


def build_document() -> dict[str, Any]:
    _, schemas = msgspec.json.schema_components(_STRUCTS, ref_template=_REF)
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "ember gateway", "version": version("ember"),
                 "description": "OpenAI-compatible LLM inference: completions, chat completions, models."},
        "security": [{"apiKey": []}, {}],  # a key only when the gateway is started with one
        "paths": {
            "/v1/completions": {"post": _post("Complete a prompt", CompletionRequest, Completion, CompletionChunk)},
            "/v1/chat/completions": {
                "post": _post("Answer a conversation", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk)
            },
            "/tokenize": {"post": _post("A prompt or messages as the model's token ids", TokenizeRequest,
                                        TokenizeResponse)},
            "/detokenize": {"post": _post("Token ids as text", DetokenizeRequest, DetokenizeResponse)},
            "/v1/models": _get("The models served", _json(ModelList, "The models")),
            "/v1/models/{model}": _get("One model", _json(Model, "The model"), parameters=[model_param]),
            "/health": _get("200 while an engine takes requests, else 503", _json(Health, "Ready"), open_path=True),
            "/metrics": _get("Prometheus metrics", {"description": "The Prometheus text format",
                                                    "content": {"text/plain": {"schema": {"type": "string"}}}},
                             open_path=True),
            "/openapi.json": _get("This document", {"description": "OpenAPI 3.1",
                                                    "content": {"application/json": {"schema": {"type": "object"}}}},
                                  open_path=True),
        },
        "components": {
            "schemas": schemas,
            "responses": {"Error": _json(ErrorResponse, "An OpenAI error body")},
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
    }


DOCUMENT = build_document()


async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(DOCUMENT)
