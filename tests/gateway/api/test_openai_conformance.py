"""ember's responses against OpenAI's published API description (the schemas vendored in
data/openai_openapi_subset.json): field names, types and required fields of every body and stream
chunk; and requests that description allows, which ember once refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonschema import Draft202012Validator

from ember_core import SamplingParams
from ember_core.runner.inputs import SamplingRequest
from ember_core.runner.sampler import sample
from tests.gateway.api.test_validation import assert_openai_error
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_engine import FakeEngine

OPENAI = json.loads((Path(__file__).parents[1] / "data" / "openai_openapi_subset.json").read_text())
MODEL = "fake-model"
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def openai_errors(instance: Any, schema_name: str) -> list[str]:
    """What OpenAI's schema finds wrong with instance: one line per error, with where it is."""
    Draft202012Validator.check_schema(OPENAI["components"]["schemas"][schema_name])
    validator = Draft202012Validator({**OPENAI, "$ref": f"#/components/schemas/{schema_name}"})
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(instance)]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, **fields}


def test_the_vendored_schemas_catch_a_missing_field():
    assert openai_errors({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]},
                         "ListModelsResponse") == ["data/0: 'created' is a required property"]


@pytest.mark.parametrize("fields", [{}, {"n": 2}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "logprobs": True}])
async def test_chat_completions_conform(gateway: Gateway, fields: dict[str, Any]):
    status, body = await gateway.post("/v1/chat/completions", chat(**fields))
    assert status == 200, body
    assert openai_errors(body, "CreateChatCompletionResponse") == []
    assert len(body["choices"]) == fields.get("n", 1)
    assert all(choice["message"]["refusal"] is None for choice in body["choices"])


@pytest.mark.parametrize(
    "fields", [{}, {"n": 2}, {"logprobs": True, "top_logprobs": 2}, {"stream_options": {"include_usage": True}}]
)
async def test_chat_stream_chunks_conform(gateway: Gateway, fields: dict[str, Any]):
    events = await gateway.stream("/v1/chat/completions", chat(stream=True, **fields))
    *chunks, done = events
    assert done == "[DONE]" and len(chunks) > 3
    for chunk in chunks:
        assert openai_errors(chunk, "CreateChatCompletionStreamResponse") == [], chunk
    assert {choice["index"] for chunk in chunks for choice in chunk["choices"]} == set(range(fields.get("n", 1)))


async def test_tool_calls_conform_whole_and_streamed(replying, start_gateway: StartGateway):
    engine = await replying(f"<tool_call>{json.dumps(CALL)}</tool_call>")
    gateway = await start_gateway(engine)
    body = chat(tools=[WEATHER], max_tokens=len(engine.reply_ids))
    status, whole = await gateway.post("/v1/chat/completions", body)
    assert status == 200 and whole["choices"][0]["message"]["tool_calls"], whole
    assert openai_errors(whole, "CreateChatCompletionResponse") == []
    chunks = (await gateway.stream("/v1/chat/completions", {**body, "stream": True}))[:-1]
    assert any("tool_calls" in choice["delta"] for chunk in chunks for choice in chunk["choices"])
    for chunk in chunks:
        assert openai_errors(chunk, "CreateChatCompletionStreamResponse") == [], chunk


@pytest.mark.parametrize("fields", [{}, {"n": 2, "logprobs": 2}, {"stop": "o"}])
async def test_completions_conform(gateway: Gateway, fields: dict[str, Any]):
    status, body = await gateway.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 6, **fields})
    assert status == 200, body
    assert openai_errors(body, "CreateCompletionResponse") == []


async def test_models_conform(gateway: Gateway):
    async with gateway.http.get("/v1/models") as response:
        assert openai_errors(await response.json(), "ListModelsResponse") == []
    async with gateway.http.get(f"/v1/models/{MODEL}") as response:
        assert openai_errors(await response.json(), "Model") == []


async def test_top_p_zero_is_accepted_and_keeps_the_most_likely_token(gateway: Gateway, fake_engine: FakeEngine):
    status, body = await gateway.post("/v1/chat/completions", chat(top_p=0, temperature=1))
    assert status == 200, body
    assert fake_engine.received[-1].sampling.top_p == 0
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.5]])  # token 1 most likely, token 2 a close second
    params = [SamplingParams(top_p=0.0, temperature=1.5, seed=seed) for seed in range(50)]
    drawn = [entry.token_id for entry in sample(logits.repeat(50, 1), [SamplingRequest(p, i) for i, p in enumerate(params)])]
    assert set(drawn) == {1}


async def test_a_refusal_part_and_a_function_message_are_rendered(replying, start_gateway: StartGateway):
    fake_engine = await replying("ok")
    gateway = await start_gateway(fake_engine)
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot say."}]},
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    status, body = await gateway.post("/v1/chat/completions", chat(messages=messages))
    assert status == 200, body
    prompt = fake_engine.tokenizer.decode(fake_engine.received[-1].prompt_token_ids)
    # a template that does not render tools reads a tool result (a function message is one) as a user turn
    assert "<|im_start|>assistant\nI cannot say.<|im_end|>\n<|im_start|>user\n<tool_response>sunny</tool_response>" in prompt
    for message, param in [
        ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "messages[0].content"),
        ({"role": "function", "content": "sunny"}, "messages[0].name"),
    ]:
        status, body = await gateway.post("/v1/chat/completions", chat(messages=[message]))
        assert assert_openai_error(status, body, 400)["param"] == param
