"""GET /openapi.json: an OpenAPI 3.1 description of the gateway. Request bodies are the msgspec
Structs that decode them (request_bodies.py), so the document cannot drift from validation; responses are
the Structs of response_bodies.py."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any, get_args

import msgspec
from aiohttp import web

from ember_gateway.api.request_bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ResponsesRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from ember_gateway.api.response_bodies import (
    AdapterChange,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    CreateEmbeddingResponse,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    Model,
    ModelList,
    TokenizeResponse,
)
from ember_gateway.api.responses.objects import Response, ResponseEvent
from ember_gateway.observability.dashboard import ASSET_TYPES
from ember_gateway.observability.dashboard_feed import DashboardUpdate
from ember_gateway.state import STATE

_REF = "#/components/schemas/{name}"
_STRUCTS = (
    ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest, ErrorResponse,
    ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, Response, *get_args(ResponseEvent), Model,
    ModelList, Health, TokenizeResponse, DetokenizeResponse, EmbeddingRequest, CreateEmbeddingResponse, DashboardUpdate,
    LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, AdapterChange,
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


def _typed_event() -> dict[str, Any]:
    """One event of a Responses stream: named by its type, its data one of the Responses events."""
    events = [_ref(event) for event in get_args(ResponseEvent)]
    payload = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": events}}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": payload}}


def _post(
    summary: str,
    body: type[msgspec.Struct],
    answer: type[msgspec.Struct],
    chunk: type[msgspec.Struct] | None = None,
    typed_events: bool = False,
) -> dict[str, Any]:
    """chunk: a stream sends these, then `[DONE]`; typed_events: a stream sends the Responses events."""
    ok = _json(answer, "The result")
    if chunk is not None:
        ok["description"] = f"The result; with stream: true, server-sent events of {chunk.__name__}, then `data: [DONE]`"
        ok["content"]["text/event-stream"] = {"schema": _event(chunk)}
    if typed_events:
        ok["description"] = ("The result; with stream: true, server-sent events named by their type, from "
                             "response.created to response.completed, response.incomplete or response.failed")
        ok["content"]["text/event-stream"] = {"schema": _typed_event()}
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


def _file(name: str, summary: str, open_path: bool = False) -> dict[str, Any]:
    """A file of the dashboard, as its media type; the page takes the key as ?key= too (app.py)."""
    media_type = ASSET_TYPES[name]
    answer = {"description": f"static/{name}", "content": {media_type: {"schema": {"type": "string"}}}}
    return _get(summary, answer, open_path) if open_path else _get(summary, answer, security=_DASHBOARD_SECURITY)


_DASHBOARD_SECURITY = [{"apiKey": []}, {"dashboardKey": []}, {}]


def _dashboard_events() -> dict[str, Any]:
    payload = {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(DashboardUpdate)}
    event = {"type": "object", "required": ["data"], "properties": {"data": payload}}
    answer = {"description": "Server-sent events of DashboardUpdate, two a second, until the client goes away",
              "content": {"text/event-stream": {"schema": event}}}
    return _get("The dashboard's live feed", answer, security=_DASHBOARD_SECURITY)


def build_document(runtime_adapters: bool) -> dict[str, Any]:
    """runtime_adapters: the gateway serves adapter loads and unloads (--allow-runtime-lora-updating)."""
    _, schemas = msgspec.json.schema_components(_STRUCTS, ref_template=_REF)
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "ember gateway", "version": version("ember"),
                 "description": "OpenAI-compatible LLM inference: completions, chat completions, responses, embeddings, models."},
        "security": [{"apiKey": []}, {}],  # a key only when the gateway is started with one
        "paths": {
            "/v1/completions": {"post": _post("Complete a prompt", CompletionRequest, Completion, CompletionChunk)},
            "/v1/chat/completions": {
                "post": _post("Answer a conversation", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk)
            },
            "/v1/responses": {
                "post": _post("Respond to input items (OpenAI's Responses API, stateless)", ResponsesRequest,
                              Response, typed_events=True)
            },
            "/v1/embeddings": {"post": _post("Embed inputs", EmbeddingRequest, CreateEmbeddingResponse)},
            "/tokenize": {"post": _post("A prompt or messages as the model's token ids", TokenizeRequest,
                                        TokenizeResponse)},
            "/detokenize": {"post": _post("Token ids as text", DetokenizeRequest, DetokenizeResponse)},
            **({
                "/v1/load_lora_adapter": {"post": _post("Load a LoRA adapter on every engine (vLLM's; needs an admin key "
                                                        "where the gateway has admin keys)", LoadLoRAAdapterRequest, AdapterChange)},
                "/v1/unload_lora_adapter": {"post": _post("Unload a LoRA adapter (vLLM's; needs an admin key where the "
                                                          "gateway has admin keys)", UnloadLoRAAdapterRequest, AdapterChange)},
            } if runtime_adapters else {}),
            "/v1/models": _get("The models served", _json(ModelList, "The models")),
            "/v1/models/{model}": _get("One model", _json(Model, "The model"), parameters=[model_param]),
            "/health": _get("200 while an engine takes requests, else 503", _json(Health, "Ready"), open_path=True),
            "/metrics": _get("Prometheus metrics", {"description": "The Prometheus text format",
                                                    "content": {"text/plain": {"schema": {"type": "string"}}}},
                             open_path=True),
            "/openapi.json": _get("This document", {"description": "OpenAPI 3.1",
                                                    "content": {"application/json": {"schema": {"type": "object"}}}},
                                  open_path=True),
            "/dashboard": _file("dashboard.html", "A live page of the engines' KV pools, queues and steps"),
            "/dashboard/events": _dashboard_events(),
            "/dashboard/dashboard.js": _file("dashboard.js", "The dashboard's script", open_path=True),
            "/dashboard/dashboard.css": _file("dashboard.css", "The dashboard's stylesheet", open_path=True),
        },
        "components": {
            "schemas": schemas,
            "responses": {"Error": _json(ErrorResponse, "An OpenAI error body")},
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer"},
                "dashboardKey": {"type": "apiKey", "in": "query", "name": "key"},
            },
        },
    }


DOCUMENTS = {runtime_adapters: build_document(runtime_adapters) for runtime_adapters in (False, True)}


async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(DOCUMENTS[request.app[STATE].config.allow_runtime_lora_updating])
