"""GET /openapi.json: valid OpenAPI 3.1, open without an API key, covering every route of the app,
and describing what the gateway really sends: the bodies that tokenize.py and errors.py build as
dicts are checked against it here (the others are built as the Structs it is made from)."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from ember_gateway.app import create_app
from ember_gateway.config import GatewayConfig
from ember_gateway.openapi import DOCUMENT
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_engine import FakeEngine

MODEL = "fake-model"


def ember_errors(instance: Any, schema_name: str) -> list[str]:
    validator = Draft202012Validator({**DOCUMENT, "$ref": f"#/components/schemas/{schema_name}"})
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(instance)]


def test_the_document_is_valid_openapi_3_1():
    validate(DOCUMENT)
    assert DOCUMENT["openapi"] == "3.1.0"


def test_every_route_is_described_and_every_description_is_a_route():
    app = create_app(GatewayConfig(engine_addresses=("tcp://127.0.0.1:1",)))
    routes = {
        (route.resource.canonical, route.method.lower())
        for route in app.router.routes()
        if route.method != "HEAD"  # aiohttp adds one beside every GET
    }
    described = {(path, method) for path, operations in DOCUMENT["paths"].items() for method in operations}
    assert routes == described
    for path, method in described - {("/metrics", "get"), ("/openapi.json", "get")}:
        responses = DOCUMENT["paths"][path][method]["responses"]
        assert "application/json" in responses["200"]["content"] and {"4XX", "5XX"} <= set(responses), path
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in DOCUMENT["paths"][path]["post"]["responses"]["200"]["content"]


def test_response_shapes_are_exact():
    """A field the gateway sends must be described: objects allow no other properties."""
    assert ember_errors({"object": "list", "data": [], "extra": 1}, "ModelList") == [
        ": Additional properties are not allowed ('extra' was unexpected)"
    ]


async def test_served_without_an_api_key(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, api_key="secret")
    async with gateway.http.get("/openapi.json") as response:
        assert response.status == 200 and await response.json() == DOCUMENT
    async with gateway.http.get("/v1/models") as response:
        assert response.status == 401


@pytest.mark.parametrize(
    "path, body, schema_name",
    [
        ("/tokenize", {"model": MODEL, "prompt": "hi"}, "TokenizeResponse"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True},
         "TokenizeResponse"),
        ("/detokenize", {"model": MODEL, "tokens": [104, 105]}, "DetokenizeResponse"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 9},
         "ErrorResponse"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, "ErrorResponse"),
    ],
)
async def test_real_bodies_match_the_document(gateway: Gateway, path: str, body: dict[str, Any], schema_name: str):
    status, answer = await gateway.post(path, body)
    assert (status == 200) == (schema_name != "ErrorResponse"), answer
    assert ember_errors(answer, schema_name) == []
