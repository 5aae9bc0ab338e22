"""Structured outputs through a real engine (the default model) and gateway, with the OpenAI SDK."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

from tests.processes import engine_argv, free_port, spawned, start_gateway


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=99)


@pytest.fixture(scope="module")
def client(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    logs = tmp_path_factory.mktemp("structured")
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = engine_argv(smollm2_gguf_path, address, "--num-blocks", "64", "--served-model-name", "smol")
    with spawned(argv, logs / "engine.log"):
        gateway = start_gateway(address, logs / "gateway.log", "--engine-wait", "60")
        yield openai.OpenAI(base_url=f"{next(gateway)}/v1", api_key="unused", max_retries=0)
        gateway.close()


def test_the_sdk_parses_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": "Tell me about Paris."}], response_format=City,
        temperature=0, max_tokens=80,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City) and City.model_validate_json(message.content) == message.parsed


def test_a_regex_and_a_choice_on_completions_and_a_streamed_schema(client: openai.OpenAI) -> None:
    regex = client.completions.create(model="smol", prompt="Call me at", max_tokens=16, temperature=0.9, seed=4, n=3,
                                      extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert all(re.fullmatch(r"\d{3}-\d{4}", choice.text) for choice in regex.choices)
    choice = client.completions.create(model="smol", prompt="Is water wet?", max_tokens=8,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    schema = {"name": "city", "schema": {**City.model_json_schema(), "additionalProperties": False}}
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "A JSON object about Rome."}], temperature=0,
        max_tokens=100, stream=True, response_format={"type": "json_schema", "json_schema": schema},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
    assert finish == "stop", text
    City.model_validate(json.loads(text))


def test_an_invalid_schema_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
    assert error.value.body["param"] == "response_format"


def test_a_required_tool_call_through_the_sdk(client: openai.OpenAI) -> None:
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False},
    }}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(model="smol", messages=messages, tools=[weather], tool_choice="required",
                                           temperature=0, max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    # the conversation goes on with the call and its result
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "21 C, sunny"}]
    answer = client.chat.completions.create(model="smol", messages=messages, tools=[weather], temperature=0, max_tokens=20)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


WEATHER_PARAMETERS = {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
}


def test_a_forced_call_of_a_strict_function_is_compact_and_short(client: openai.OpenAI) -> None:
    """No additionalProperties in its schema: strict mode closes it, so the model cannot invent keys."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                "parameters": WEATHER_PARAMETERS, "strict": True}}
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What's the weather in Oslo?"}], tools=[weather],
        tool_choice="required", temperature=0, max_tokens=80,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and reply.usage.completion_tokens <= 40, choice.message
    for call in choice.message.tool_calls:
        assert set(json.loads(call.function.arguments)) == {"city", "unit"}


def test_a_strict_response_format_admits_only_its_properties_and_whitespace_is_asked_for(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    messages = [{"role": "user", "content": "A JSON object about Rome."}]
    strict = client.chat.completions.create(
        model="smol", messages=messages, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
    )
    content = strict.choices[0].message.content
    assert strict.choices[0].finish_reason == "stop" and set(json.loads(content)) == {"city"}
    assert "\n" not in content and "  " not in content  # compact
    spaced = client.chat.completions.create(
        model="smol", messages=messages, temperature=0, max_tokens=60, extra_body={"json_any_whitespace": True},
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
    )
    assert json.loads(spaced.choices[0].message.content).keys() == {"city"}


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)


def test_the_sdk_reassembles_a_streamed_tool_call(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather", description="Current weather of a city")
    with client.chat.completions.stream(
        model="smol", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[tool], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60,
    ) as stream:
        events = [event.type for event in stream]
        completion = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls  # parsed by the SDK: a pydantic tool is strict
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


SCHEMAS = json.loads((Path(__file__).parents[1] / "core" / "data" / "json_schemas.json").read_text())


async def test_twenty_schemas_streamed_with_n_3_validate(client: openai.OpenAI) -> None:
    """Sampled, 3 choices each, all at once: 60 sequences in a 64-block pool, so some are preempted."""
    async_client = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)

    async def texts(index: int, schema: dict) -> tuple[list[str], list[str]]:
        stream = await async_client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": f"Answer in JSON ({index})."}], n=3, temperature=1.0,
            seed=index, max_tokens=64, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": f"schema_{index}", "schema": schema}},
        )
        parts, finishes = [[] for _ in range(3)], [""] * 3
        async for chunk in stream:
            for choice in chunk.choices:
                parts[choice.index].append(choice.delta.content or "")
                finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        return ["".join(p) for p in parts], finishes

    results = await asyncio.gather(*(texts(index, schema) for index, schema in enumerate(SCHEMAS)))
    await async_client.close()
    metrics = await asyncio.to_thread(_get, str(client.base_url).removesuffix("v1/") + "metrics")
    assert re.search(r"^ember_num_preemptions_total\{.*\} [1-9]", metrics, re.MULTILINE), metrics
    for schema, (outputs, finishes) in zip(SCHEMAS, results):
        for text, finish in zip(outputs, finishes):
            if finish != "length":
                assert finish == "stop"
                jsonschema.validate(json.loads(text), schema)
    assert sum(finish == "stop" for _, finishes in results for finish in finishes) >= 45


def _get(url: str) -> str:
    with urllib.request.urlopen(url) as response:
        return response.read().decode()
