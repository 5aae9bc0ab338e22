"""Tool calling in chat against a fake engine that answers with a given text: the calls read back,
streamed, constrained when forced, and a conversation holding calls and their results."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ember_gateway.tools import ToolPlan, parse_calls
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_engine import FakeEngine
from tests.processes import free_port

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.fixture
async def replying() -> AsyncIterator[Any]:
    engines: list[FakeEngine] = []

    async def start(reply: str) -> FakeEngine:
        engine = FakeEngine(f"tcp://127.0.0.1:{free_port()}", reply_text=reply, max_model_len=4096)
        await engine.start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.stop()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            **fields}


async def test_auto_reads_hermes_calls_and_leaves_plain_answers_as_text(replying, start_gateway: StartGateway):
    engine = await replying(f"Let me look.<tool_call>{json.dumps(CALL)}</tool_call>")
    gateway = await start_gateway(engine)
    status, body = await gateway.post("/v1/chat/completions", chat(tool_choice="auto", max_tokens=len(engine.reply_ids)))
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["content"] == "Let me look."
    plain = await start_gateway(await replying("It is sunny."))
    status, body = await plain.post("/v1/chat/completions", chat(max_tokens=12))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert body["choices"][0]["finish_reason"] == "length"  # the engine's, as without tools


async def test_a_stream_sends_the_calls_in_one_delta(replying, start_gateway: StartGateway):
    engine = await replying(json.dumps([CALL, {**CALL, "arguments": {"city": "Rome"}}]))
    gateway = await start_gateway(engine)
    request = chat(tool_choice="required", stream=True, max_tokens=len(engine.reply_ids))
    events = await gateway.stream("/v1/chat/completions", request)
    deltas = [event["choices"][0] for event in events[:-1] if event["choices"]]
    calls = [call for delta in deltas for call in delta["delta"].get("tool_calls", [])]
    assert [(c["index"], json.loads(c["function"]["arguments"])["city"]) for c in calls] == [(0, "Paris"), (1, "Rome")]
    assert deltas[-1]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"


async def test_a_forced_call_is_constrained_to_the_function_s_parameters(replying, start_gateway: StartGateway):
    engine = await replying(json.dumps(CALL))
    gateway = await start_gateway(engine)
    named = {"type": "function", "function": {"name": "get_weather"}}
    status, body = await gateway.post("/v1/chat/completions", chat(tool_choice=named, max_tokens=len(engine.reply_ids)))
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
    schema = json.loads(engine.received[-1].sampling.structured_outputs.json)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]
    await gateway.post("/v1/chat/completions", chat(tool_choice="required", max_tokens=len(engine.reply_ids)))
    assert json.loads(engine.received[-1].sampling.structured_outputs.json)["type"] == "array"


async def test_a_conversation_with_calls_and_results_reaches_the_model_as_text(replying, start_gateway: StartGateway):
    engine = await replying("It is 21 degrees.")
    gateway: Gateway = await start_gateway(engine)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    status, body = await gateway.post("/v1/chat/completions", chat(messages=messages, max_tokens=17))
    assert status == 200 and body["choices"][0]["message"]["content"] == "It is 21 degrees."
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert "get_weather" in prompt and '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<tool_response>21 C</tool_response>" in prompt


def test_parsing_takes_llama_style_json_and_one_call_without_parallel_tool_calls() -> None:
    plan = ToolPlan([WEATHER], "auto", parallel=False)
    content, calls = parse_calls(plan, json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}, CALL]))
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}]
    assert parse_calls(plan, '{"answer": 42}') == ('{"answer": 42}', [])
