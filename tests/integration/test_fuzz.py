"""Property-based fuzz with schemathesis: requests generated from the running gateway's own
/openapi.json, valid ones and invalid ones, against every POST route of a real engine and gateway.
Checked: no 5xx, every 4xx an OpenAI error body, every response (and stream event) as the document
describes it, and a greedy request answering the same before and after.

Bounded to about a minute on 2 cores: 240 examples in all, and every generation is kept short (the
document's max_tokens and n lowered here, larger generated values clamped). The seed is fixed;
EMBER_FUZZ_SEED picks another, and a failure prints the one it ran with (`make fuzz`)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from jsonschema import Draft202012Validator
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from ember_gateway.api.responses.objects import ResponseEvent
from tests.gateway.conftest import parse_sse
from tests.processes import engine_argv, free_port, spawned, start_gateway

pytestmark = pytest.mark.fuzz

SEED = int(os.environ.get("EMBER_FUZZ_SEED", "20250601"))
MODEL = "smol"
VOCAB_SIZE = 49152  # SmolLM2's
# The gateway serves adapter loads, its engine refuses them: every load is the engine's 403, every
# unload the gateway's 404.
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize",
               *ADAPTER_ROUTES)
EXAMPLES = {"/v1/completions": 40, "/v1/chat/completions": 40, "/v1/responses": 30, "/v1/embeddings": 20,
            "/tokenize": 20, "/detokenize": 20, "/v1/load_lora_adapter": 10, "/v1/unload_lora_adapter": 10}  # per mode
REQUESTS = ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "EmbeddingRequest", "TokenizeRequest",
            "DetokenizeRequest")
# Generated values above these are clamped, so every request generates a few tokens at most.
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "min_tokens": 4, "n": 2}
GREEDY = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0,
          "max_tokens": 8}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# fields ember takes only at their no-op values (api/request_bodies.py): anything else is a 400
NO_OP_ONLY = {"tool_choice", "function_call", "use_beam_search", "bad_words", "allowed_token_ids", "prompt_logprobs",
              "truncate_prompt_tokens", "suffix", "audio", "store", "previous_response_id", "background",
              "conversation", "reasoning", "include", "top_logprobs", "truncation", "dimensions"}
REF_TEXT, REF_MESSAGE = "#/components/schemas/TextPart", "#/components/schemas/ChatMessage"
STREAM_EVENTS = {"/v1/completions": "CompletionChunk", "/v1/chat/completions": "ChatCompletionChunk"}
# The Responses API streams typed events (`event: TYPE`) and no [DONE]; the last is one of these.
RESPONSE_EVENTS = tuple(event.__name__ for event in get_args(ResponseEvent))
LAST_RESPONSE_EVENTS = {"response.completed", "response.incomplete", "response.failed"}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def _greedy_text(url: str) -> str:
    return _post(f"{url}/v1/chat/completions", GREEDY)["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def gateway_url(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("fuzz")
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = engine_argv(smollm2_gguf_path, address, "--num-blocks", "64", "--max-model-len", "256",
                       "--served-model-name", MODEL)
    with spawned(argv, logs / "engine.log"):
        gateway = start_gateway(address, logs / "gateway.log", "--engine-wait", "60", "--request-timeout", "30",
                                "--allow-runtime-lora-updating")
        yield next(gateway)
        gateway.close()


@pytest.fixture(scope="module")
def greedy_before(gateway_url: str) -> str:
    return _greedy_text(gateway_url)


@pytest.fixture(scope="module")
def document(gateway_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{gateway_url}/openapi.json", timeout=10) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def schema(document: dict[str, Any]) -> schemathesis.BaseSchema:
    """The gateway's document with valid requests kept cheap (its model, low maxima) and likelier to
    pass the checks after decoding (non-empty prompts, token ids in the vocabulary); no unknown
    fields, which the gateway ignores."""
    fuzzed = json.loads(json.dumps(document))
    schemas = fuzzed["components"]["schemas"]
    for name in (*REQUESTS, "ChatMessage"):
        schemas[name]["additionalProperties"] = False
    for name in REQUESTS:
        properties = schemas[name]["properties"]
        properties["model"] = {"const": MODEL}
        for field, cap in CAPS.items():
            for option in properties.get(field, {}).get("anyOf", []):
                if option.get("type") == "integer":
                    option["maximum"] = cap
        for field in NO_OP_ONLY & set(properties):
            properties[field] = {"type": "null"}
    token_id = {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}
    text = {"type": "string", "minLength": 1}
    schemas["CompletionRequest"]["properties"]["prompt"] = schemas["EmbeddingRequest"]["properties"]["input"] = {"anyOf": [
        text, {"type": "array", "minItems": 1, "items": text},
        {"type": "array", "minItems": 1, "items": token_id},
    ]}
    schemas["DetokenizeRequest"]["properties"]["tokens"] = {"type": "array", "items": token_id}
    # content: only an assistant's may be null; name: a function message's is required
    message = schemas["ChatMessage"]
    message["properties"]["content"]["anyOf"] = [text, {"type": "array", "minItems": 1, "items": {"$ref": REF_TEXT}}]
    message["required"] = ["role", "content", "name"]
    tokenize = schemas["TokenizeRequest"]  # a prompt or messages, not both
    tokenize["properties"]["prompt"] = text
    tokenize["properties"]["messages"].pop("anyOf", None)
    tokenize["properties"]["messages"].update(type="array", minItems=1, items={"$ref": REF_MESSAGE})
    tokenize["oneOf"] = [{"required": ["prompt"], "not": {"required": ["messages"]}},
                         {"required": ["messages"], "not": {"required": ["prompt"]}}]
    return schemathesis.openapi.from_dict(fuzzed)


def _prepared(body: Any) -> Any:
    """A generated body made cheap to answer: counts clamped, max_tokens set where none is; and
    integral floats (1.0, which JSON Schema counts as an integer) written as integers, which
    msgspec's strict decoding requires."""
    if isinstance(body, float) and body.is_integer():
        return int(body)
    if isinstance(body, list):
        return [_prepared(item) for item in body]
    if not isinstance(body, dict):
        return body
    body = {key: _prepared(value) for key, value in body.items()}
    for field, cap in CAPS.items():
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[field] = cap
    if ("messages" in body or "prompt" in body) and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = CAPS["max_tokens"]
    if "input" in body and "encoding_format" not in body and body.get("max_output_tokens") is None:  # a Response
        body["max_output_tokens"] = CAPS["max_output_tokens"]
    return body


def _check_stream(text: str, validator: Draft202012Validator, note: str) -> None:
    *events, done = parse_sse(text)
    assert done == "[DONE]", note
    for event in events:
        errors = [error.message for error in validator.iter_errors(event)]
        assert not errors, (note, event, errors)


def _check_response_stream(text: str, validator: Draft202012Validator, note: str) -> None:
    events = []
    for block in filter(None, text.split("\n\n")):
        name_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {event['type']}", note
        errors = [error.message for error in validator.iter_errors(event)]
        assert not errors, (note, event, errors)
        events.append(event)
    assert events and events[-1]["type"] in LAST_RESPONSE_EVENTS, note
    assert [event["sequence_number"] for event in events] == list(range(len(events))), note


def test_the_fuzz_covers_every_post_route(document: dict[str, Any]):
    assert {path for path, operations in document["paths"].items() if "post" in operations} == set(POST_ROUTES)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda mode: mode.value)
@pytest.mark.parametrize("path", POST_ROUTES)
def test_fuzz(gateway_url: str, greedy_before: str, document: dict[str, Any], schema: schemathesis.BaseSchema,
              path: str, mode: GenerationMode):
    print(f"fuzz seed: EMBER_FUZZ_SEED={SEED}")
    operation = schema[path]["POST"]
    if path == "/v1/responses":
        check_stream = _check_response_stream
        events = {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in RESPONSE_EVENTS]}
        stream_validator = Draft202012Validator({**document, **events})
    else:
        check_stream = _check_stream
        stream_validator = Draft202012Validator({**document, "$ref": f"#/components/schemas/{STREAM_EVENTS.get(path)}"})

    @hypothesis.seed(SEED)
    @hypothesis.settings(
        max_examples=EXAMPLES[path], deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck), print_blob=True,
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        case.body = _prepared(case.body)
        response = case.call(base_url=gateway_url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        note = f"EMBER_FUZZ_SEED={SEED}\n{case.as_curl_command()}\n-> {response.status_code} {response.text[:2000]}"
        case.validate_response(response, checks=CHECKS)
        if response.headers.get("Content-Type", "").startswith("text/event-stream"):
            check_stream(response.text, stream_validator, note)
        if 400 <= response.status_code < 500:
            error = response.json().get("error")
            assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, note

    statuses: dict[int, int] = {}
    fuzz()
    print(f"{path} {mode.value}: {statuses}")
    if mode is GenerationMode.POSITIVE and path not in ADAPTER_ROUTES:  # else the fuzz never got past validation
        assert statuses.get(200), statuses


def test_greedy_answer_is_unchanged_after_the_fuzz(gateway_url: str, greedy_before: str):
    assert _greedy_text(gateway_url) == greedy_before, f"EMBER_FUZZ_SEED={SEED}"
