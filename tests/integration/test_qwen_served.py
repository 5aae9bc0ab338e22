"""A Qwen2 checkpoint (random weights, a byte-level BPE tokenizer, Qwen2.5's own chat template with its
`<tool_call>` blocks) served by `ember serve` end to end: chat, streaming, structured outputs and
tool calls through the OpenAI SDK."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pydantic
import pytest

from tests.processes import served

pytest.importorskip("transformers")
from ember_bench.random_models import random_checkpoint

TEMPLATE = Path(__file__).parents[1] / "core" / "data" / "chat_templates" / "qwen2.5-instruct.jinja"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    population_millions: int = pydantic.Field(ge=0, le=99)


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model_dir = random_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2") / "model", num_hidden_layers=2,
                                  max_position_embeddings=2048)  # room for the tools' system prompt
    shutil.copy(TEMPLATE, model_dir / "chat_template.jinja")
    with served(model_dir, model_dir.parent / "serve.log", "--model-name", "qwen") as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_chat_and_its_stream_agree(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    reply = client.chat.completions.create(model="qwen", messages=messages, temperature=0, max_tokens=12)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="qwen", messages=messages, temperature=0, max_tokens=12,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert reply.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_a_pydantic_response_format(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="qwen", messages=[{"role": "user", "content": "A city, as JSON."}], response_format=City,
        temperature=0, max_tokens=150,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)


def test_a_required_tool_call_and_its_result_through_qwens_template(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather", description="Current weather of a city")
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = client.chat.completions.create(model="qwen", messages=messages, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=150)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    GetWeather.model_validate(json.loads(call.function.arguments))
    # the call and its result go back through Qwen's template: <tool_call> and <tool_response> blocks
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    answer = client.chat.completions.create(model="qwen", messages=messages, tools=[tool], temperature=0,
                                            max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_a_streamed_tool_call(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather", description="Current weather of a city")
    with client.chat.completions.stream(
        model="qwen", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[tool], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=150,
    ) as stream:
        events = [event.type for event in stream]
        completion = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    (call,) = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)
