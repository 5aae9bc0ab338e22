"""GET /openapi.json: valid OpenAPI 3.1, open without an API key, and covering every route of the
app. Every body the gateway sends is built as a Struct of api/response_bodies.py, which the document is made
from, so real bodies are not checked against it here."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from ember_gateway.api.openapi import DOCUMENTS
from ember_gateway.app import create_app
from ember_gateway.config import GatewayConfig
from tests.gateway.conftest import StartGateway
from tests.gateway.fake_engine import FakeEngine

DOCUMENT = DOCUMENTS[True]  # every route's: with runtime adapter loads allowed


def ember_errors(instance: Any, schema_name: str) -> list[str]:
    validator = Draft202012Validator({**DOCUMENT, "$ref": f"#/components/schemas/{schema_name}"})
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(instance)]


def test_the_document_is_valid_openapi_3_1():
    for document in DOCUMENTS.values():
        validate(document)
        assert document["openapi"] == "3.1.0"


@pytest.mark.parametrize("runtime_adapters", [False, True])
def test_every_route_is_described_and_every_description_is_a_route(runtime_adapters: bool):
    config = GatewayConfig(engine_addresses=("tcp://127.0.0.1:1",), allow_runtime_lora_updating=runtime_adapters)
    routes = {
        (route.resource.canonical, route.method.lower())
        for route in create_app(config).router.routes()
        if route.method != "HEAD"  # aiohttp adds one beside every GET
    }
    described = {(path, method) for path, operations in DOCUMENTS[runtime_adapters]["paths"].items() for method in operations}
    assert routes == described
    assert (("/v1/load_lora_adapter", "post") in routes) is runtime_adapters
    not_json = {"/metrics": "text/plain", "/openapi.json": "application/json", "/dashboard": "text/html",
                "/dashboard/events": "text/event-stream", "/dashboard/dashboard.js": "text/javascript",
                "/dashboard/dashboard.css": "text/css"}
    for path, media_type in not_json.items():
        assert media_type in DOCUMENT["paths"][path]["get"]["responses"]["200"]["content"], path
    for path, method in described - {(path, "get") for path in not_json}:
        responses = DOCUMENT["paths"][path][method]["responses"]
        assert "application/json" in responses["200"]["content"] and {"4XX", "5XX"} <= set(responses), path
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert "text/event-stream" in DOCUMENT["paths"][path]["post"]["responses"]["200"]["content"]


def test_response_shapes_are_exact():
    """A field the gateway sends must be described: objects allow no other properties."""
    assert ember_errors({"object": "list", "data": [], "extra": 1}, "ModelList") == [
        ": Additional properties are not allowed ('extra' was unexpected)"
    ]


async def test_served_without_an_api_key(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, api_key="secret")
    async with gateway.http.get("/openapi.json") as response:
        assert response.status == 200 and await response.json() == DOCUMENTS[False]
    async with gateway.http.get("/v1/models") as response:
        assert response.status == 401
