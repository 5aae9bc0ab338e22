"""POST /v1/responses through a real engine (the default model) and gateway, with the unmodified
OpenAI SDK: responses.create, responses.stream, responses.parse, and a function call round trip."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pydantic
import pytest

from tests.processes import engine_argv, free_port, spawned, start_gateway

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


@pytest.fixture(scope="module")
def client(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    logs = tmp_path_factory.mktemp("responses")
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = engine_argv(smollm2_gguf_path, address, "--num-blocks", "64", "--served-model-name", "smol",
                       "--scheduling-policy", "priority")
    with spawned(argv, logs / "engine.log"):
        gateway = start_gateway(address, logs / "gateway.log", "--engine-wait", "60")
        yield openai.OpenAI(base_url=f"{next(gateway)}/v1", api_key="unused", max_retries=0)
        gateway.close()


def test_create_answers_with_a_message(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="smol", instructions="Answer in one sentence.", input="What is the capital of France?",
        temperature=0, max_output_tokens=40, metadata={"test": "create"}, extra_body={"priority": 1},
    )
    assert response.status in ("completed", "incomplete") and response.output[0].type == "message"
    assert "Paris" in response.output_text
    assert response.usage.output_tokens <= 40 and response.usage.total_tokens > response.usage.output_tokens
    assert response.metadata == {"test": "create"} and response.instructions == "Answer in one sentence."


def test_stream_events_make_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model="smol", instructions="Answer in one sentence.", input="What is the capital of France?",
                                 temperature=0, max_output_tokens=60) as stream:
        events = list(stream)
        # the SDK's final response needs response.completed; response.incomplete carries its own
        final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert final.output_text == "".join(deltas) and "Paris" in final.output_text


def test_parse_gives_the_pydantic_model(client: openai.OpenAI) -> None:
    response = client.responses.parse(
        model="smol", input="Tell me about Paris as JSON.", text_format=City, temperature=0, max_output_tokens=60,
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City) and City.model_validate_json(response.output_text)


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    conversation: list = [{"role": "user", "content": "What's the weather in Oslo?"}]
    called = client.responses.create(
        model="smol", input=conversation, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        temperature=0, max_output_tokens=40,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert called.status == "completed" and len(calls) == 1, called.output
    assert calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    conversation += [item.model_dump(exclude_none=True) for item in called.output]
    conversation.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C, sunny"})
    answer = client.responses.create(model="smol", input=conversation, tools=[WEATHER], temperature=0,
                                     max_output_tokens=30)
    assert answer.status in ("completed", "incomplete") and answer.output


def test_stored_state_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    for fields, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")):
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model="smol", input="hi", **fields)
        assert error.value.body["param"] == param and "input items" in error.value.body["message"]
