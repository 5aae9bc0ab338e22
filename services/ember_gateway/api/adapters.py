"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's shapes: a LoRA adapter loaded on
every engine taking requests, or on none (where one refuses, the others unload it again), then
served as a model of its own, its `parent` the engine's model, and loaded again on an engine that
restarts or joins (engines/loaded_adapters.py)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ember_gateway.api.completions.respond import json_response
from ember_gateway.api.request_bodies import Body, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, decode_body
from ember_gateway.api.response_bodies import AdapterChange
from ember_gateway.edge.errors import ApiError, engine_unavailable
from ember_gateway.edge.intake import check_framing, read_body
from ember_gateway.engines.client import EngineClient
from ember_gateway.engines.loaded_adapters import ADAPTER_TIMEOUT_S, adapter_message
from ember_gateway.state import STATE, GatewayState
from ember_proto import AdapterDone, LoadAdapter, UnloadAdapter


async def _accept(request: web.Request, body_type: type[Body]) -> tuple[GatewayState, Body]:
    state = request.app[STATE]
    check_framing(request, state.config.max_body_bytes)
    await state.await_models()  # no engine: 503 whatever the body
    raw = await read_body(request, state.config.max_body_bytes, state.config.body_timeout)
    return state, decode_body(raw, body_type)


async def _change(engines: list[EngineClient], make: type[LoadAdapter | UnloadAdapter], *args: str) -> list[AdapterDone]:
    return list(await asyncio.gather(
        *(engine.change_adapter(adapter_message(make, *args), ADAPTER_TIMEOUT_S) for engine in engines)
    ))  # fmt: skip


def _refusal(answer: AdapterDone, param: str) -> ApiError:
    return ApiError(answer.code, answer.message, param=param) if answer.code != 503 else engine_unavailable(answer.message)


async def load_lora_adapter(request: web.Request) -> web.Response:
    state, body = await _accept(request, LoadLoRAAdapterRequest)
    if any(model.name == body.lora_name for model in state.pool.models()):
        raise ApiError(400, f"a model or adapter named `{body.lora_name}` is served already", param="lora_name")
    engines = state.pool.accepting()
    answers = await _change(engines, LoadAdapter, body.lora_name, body.lora_path)
    refused = next((answer for answer in answers if answer.code != 200), None)
    if refused is not None:
        loaded = [engine for engine, answer in zip(engines, answers) if answer.code == 200]
        await _change(loaded, UnloadAdapter, body.lora_name)
        raise _refusal(refused, "lora_path")
    state.pool.loaded_adapters.paths[body.lora_name] = body.lora_path
    return json_response(AdapterChange(
        object="lora_adapter", lora_name=body.lora_name, status="loaded",
        message=f"Success: LoRA adapter '{body.lora_name}' added successfully.",
    ))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state, body = await _accept(request, UnloadLoRAAdapterRequest)
    engines = [engine for engine in state.pool.accepting() if body.lora_name in engine.adapters.names]
    if not engines:
        raise ApiError(404, f"The model `{body.lora_name}` does not exist.", param="lora_name", code="model_not_found")
    refused = next((answer for answer in await _change(engines, UnloadAdapter, body.lora_name) if answer.code != 200), None)
    if refused is not None:
        raise _refusal(refused, "lora_name")
    state.pool.loaded_adapters.paths.pop(body.lora_name, None)
    return json_response(AdapterChange(
        object="lora_adapter", lora_name=body.lora_name, status="unloaded",
        message=f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
    ))
