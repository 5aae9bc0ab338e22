"""GET /v1/models and /v1/models/{model}: the models the engines serve."""

from __future__ import annotations

from aiohttp import web

from ember_gateway.api.completions.respond import json_response
from ember_gateway.api.response_bodies import Model, ModelList
from ember_gateway.engines.served_model import ServedModel
from ember_gateway.state import STATE


def _model_entry(model: ServedModel) -> Model:
    return Model(
        id=model.name,
        object="model",
        created=model.card.created,
        owned_by="ember",
        max_model_len=model.card.max_model_len,
        dtype=model.card.dtype or None,
        numerics=model.card.numerics or None,
        kv_cache_dtype=model.card.kv_cache_dtype or None,
        cpu_build=model.card.cpu_build or None,
        parent=model.parent,
    )


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[STATE].await_models()
    return json_response(ModelList(object="list", data=[_model_entry(model) for model in models]))


async def get_model(request: web.Request) -> web.Response:
    return json_response(_model_entry(await request.app[STATE].await_model(request.match_info["model"])))
