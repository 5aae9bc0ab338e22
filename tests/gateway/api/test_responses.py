"""POST /v1/responses against a fake engine: bodies and every stream event checked against OpenAI's
published schemas, the order and numbering of events, input items as the prompt the engine gets,
tools, text.format, and the 400s for what a stateless text-only gateway does not do."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest

from ember_gateway.api.responses.objects import ResponseEvent
from ember_proto import StructuredOutputs
from tests.gateway.api.test_openai_conformance import openai_errors
from tests.gateway.api.test_openapi import ember_errors
from tests.gateway.api.test_validation import assert_openai_error
from tests.gateway.conftest import Gateway, ReplyingEngine, StartGateway
from tests.gateway.fake_engine import EOS, FakeEngine

MODEL = "fake-model"
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# the schema of each event type, by the name OpenAI's description gives it
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
}
TEXT_EVENTS = [
    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
]
EMBER_EVENTS = {event.__struct_config__.tag: event.__name__ for event in get_args(ResponseEvent)}
CALL_EVENTS = [
    "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.output_item.done",
]


def create(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 200, **fields}


async def stream(gateway: Gateway, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed response, each checked against its schema and its SSE name."""
    async with gateway.http.post("/v1/responses", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"] == "text/event-stream"
        text = await response.text()
    events = []
    for block in filter(None, text.split("\n\n")):
        name_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {event['type']}"
        assert openai_errors(event, EVENT_SCHEMAS[event["type"]]) == [], event
        assert openai_errors(event, "ResponseStreamEvent") == [], event
        assert ember_errors(event, EMBER_EVENTS[event["type"]]) == [], event  # as /openapi.json describes it
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def squeeze(types: list[str]) -> list[str]:
    """The event types with each run of deltas as one."""
    return [kind for index, kind in enumerate(types) if not (kind.endswith(".delta") and types[index - 1] == kind)]


@pytest.fixture
async def replying_gateway(replying: ReplyingEngine, start_gateway: StartGateway):
    async def start(reply: str) -> tuple[FakeEngine, Gateway]:
        engine = await replying(reply)
        return engine, await start_gateway(engine)

    return start


async def test_a_text_response_conforms_and_echoes_the_request(replying_gateway):
    engine, gateway = await replying_gateway(f"Paris is lovely.{EOS}")
    body = create(instructions="Be brief.", temperature=0.5, metadata={"team": "a"}, user="u1")
    status, response = await gateway.post("/v1/responses", body)
    assert status == 200, response
    assert openai_errors(response, "Response") == [] and ember_errors(response, "Response") == []
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["id"].startswith("resp_") and response["object"] == "response"
    [message] = response["output"]
    assert message["id"].startswith("msg_") and message["status"] == "completed"
    text = {"type": "output_text", "text": "Paris is lovely.", "annotations": [], "logprobs": []}
    assert message["content"] == [text]
    assert (response["instructions"], response["temperature"], response["top_p"]) == ("Be brief.", 0.5, 1.0)
    assert (response["metadata"], response["user"], response["store"]) == ({"team": "a"}, "u1", False)
    assert response["text"] == {"format": {"type": "text"}} and response["tools"] == []
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    usage = response["usage"]
    assert usage["input_tokens"] == len(engine.received[-1].prompt_token_ids)
    assert usage["output_tokens"] == len("Paris is lovely.") + 1  # one token a byte, and the EOS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_max_output_tokens_makes_it_incomplete(replying_gateway):
    _, gateway = await replying_gateway("A long answer that goes on")
    status, response = await gateway.post("/v1/responses", create(max_output_tokens=6))
    assert status == 200 and openai_errors(response, "Response") == []
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    assert response["output"][0]["content"][0]["text"] == "A long"
    events = await stream(gateway, create(max_output_tokens=6))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_a_stream_sends_the_typed_events_in_order(replying_gateway):
    _, gateway = await replying_gateway(f"Hello there{EOS}")
    events = await stream(gateway, create())
    types = [event["type"] for event in events]
    assert squeeze(types) == ["response.created", "response.in_progress", *TEXT_EVENTS, "response.completed"]
    deltas = [event["delta"] for event in events if event["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Hello there" and len(deltas) > 1
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    item_done = next(event["item"] for event in events if event["type"] == "response.output_item.done")
    assert final["status"] == "completed" and final["output"] == [item_done]
    assert item_done["content"][0]["text"] == "Hello there"
    assert {event.get("item_id", item_done["id"]) for event in events} == {item_done["id"]}
    assert final["usage"]["output_tokens"] == len("Hello there") + 1


async def test_a_function_call_whole_and_streamed(replying_gateway):
    engine, gateway = await replying_gateway(f"<tool_call>{json.dumps(CALL)}</tool_call>{EOS}")
    body = create(tools=[WEATHER])
    status, response = await gateway.post("/v1/responses", body)
    assert status == 200 and openai_errors(response, "Response") == []
    [call] = response["output"]
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["name"], call["status"]) == ("get_weather", "completed")
    assert json.loads(call["arguments"]) == CALL["arguments"]
    assert response["tools"] == [WEATHER] and response["tool_choice"] == "auto"
    assert "get_weather" in engine.tokenizer.decode(engine.received[-1].prompt_token_ids)  # described to the model

    events = await stream(gateway, body)
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", *CALL_EVENTS, "response.completed"
    ]
    added, delta, done, item_done = events[2:6]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"]
    assert events[-1]["response"]["output"] == [item_done["item"]]


async def test_text_then_a_call_are_two_items(replying_gateway):
    _, gateway = await replying_gateway(f"Let me look. <tool_call>{json.dumps(CALL)}</tool_call>{EOS}")
    status, response = await gateway.post("/v1/responses", create(tools=[WEATHER]))
    assert status == 200
    assert [item["type"] for item in response["output"]] == ["message", "function_call"]
    assert response["output"][0]["content"][0]["text"] == "Let me look."
    events = await stream(gateway, create(tools=[WEATHER]))
    types = squeeze([event["type"] for event in events])
    assert types == ["response.created", "response.in_progress", *TEXT_EVENTS, *CALL_EVENTS, "response.completed"]
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["message", "function_call"]


async def test_a_forced_call_is_constrained_to_the_function(replying_gateway):
    engine, gateway = await replying_gateway(f"{json.dumps(CALL)}{EOS}")
    status, response = await gateway.post(
        "/v1/responses", create(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    )
    assert status == 200 and response["output"][0]["type"] == "function_call", response
    assert response["tool_choice"] == {"type": "function", "name": "get_weather"}
    schema = json.loads(engine.received[-1].sampling.structured_outputs.json)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"]["additionalProperties"] is False  # strict, as OpenAI's default


async def test_input_items_become_the_conversation(replying_gateway):
    engine, gateway = await replying_gateway(f"Sunny.{EOS}")
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": json.dumps(CALL["arguments"]), "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer in one word."}]},
    ]
    status, response = await gateway.post("/v1/responses", create(input=items, tools=[WEATHER]))
    assert status == 200, response
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    turns = prompt.split("<|im_start|>")[1:]
    assert turns[1] == "user\nWeather in Paris?<|im_end|>\n"
    assert turns[2] == f"assistant\nChecking.\n<tool_call>{json.dumps(CALL)}</tool_call><|im_end|>\n"
    assert turns[3] == "user\n<tool_response>18 C</tool_response><|im_end|>\n"
    assert turns[4] == "system\nAnswer in one word.<|im_end|>\n" and turns[5] == "assistant\n"


async def test_text_format_and_priority_reach_the_engine(gateway: Gateway, fake_engine: FakeEngine):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    body = create(text={"format": fmt}, priority=-2, max_output_tokens=4)
    status, response = await gateway.post("/v1/responses", body)
    assert status == 200 and openai_errors(response, "Response") == [], response
    sampling = fake_engine.received[-1].sampling
    assert json.loads(sampling.structured_outputs.json) == {**schema, "additionalProperties": False}
    assert sampling.priority == -2 and sampling.max_tokens == 4
    assert response["text"] == {"format": fmt}
    body = create(text={"format": {"type": "json_object"}}, max_output_tokens=4)
    status, _ = await gateway.post("/v1/responses", body)
    assert status == 200 and fake_engine.received[-1].sampling.structured_outputs == StructuredOutputs(json_object=True)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
        ({"input": [{"type": ["message"]}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": {}}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": None}]}, "input[0].content"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"metadata": {"k": "v" * 513}}, "metadata[...]"),  # msgspec's name for a map's value
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"priority": "high"}, "priority"),
    ],
)
async def test_what_ember_does_not_do_is_a_400_naming_the_field(replying_gateway, fields: dict[str, Any], param: str):
    _, gateway = await replying_gateway("x")
    status, body = await gateway.post("/v1/responses", create(**fields))
    assert_openai_error(status, body, 400)
    assert body["error"]["param"] == param, body


async def test_store_false_and_the_no_op_values_pass(replying_gateway):
    _, gateway = await replying_gateway(f"ok{EOS}")
    fields = {"store": False, "background": False, "previous_response_id": None, "truncation": "disabled",
              "include": [], "parallel_tool_calls": False, "text": {"format": {"type": "text"}, "verbosity": "low"}}
    status, response = await gateway.post("/v1/responses", create(**fields))
    assert status == 200 and openai_errors(response, "Response") == [], response
    assert response["parallel_tool_calls"] is False


async def test_a_stream_that_fails_after_its_200_ends_with_response_failed(fake_engine: FakeEngine,
                                                                           start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, request_timeout=0.3)
    fake_engine.step_interval = 0.05
    events = await stream(gateway, create(max_output_tokens=40, input="x"))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert "timeout" in failed["response"]["error"]["message"]
    assert [item["type"] for item in failed["response"]["output"]] == ["message"]


@pytest.mark.parametrize(("parallel", "num_calls"), [(True, 2), (False, 1)])
async def test_calls_apart_by_whitespace_make_no_message(replying_gateway, parallel: bool, num_calls: int):
    other = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    _, gateway = await replying_gateway(
        f"<tool_call>{json.dumps(CALL)}</tool_call>\n<tool_call>{json.dumps(other)}</tool_call>\n{EOS}"
    )
    body = create(tools=[WEATHER], parallel_tool_calls=parallel)
    status, response = await gateway.post("/v1/responses", body)
    assert status == 200 and [item["type"] for item in response["output"]] == ["function_call"] * num_calls
    events = await stream(gateway, body)
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", *CALL_EVENTS * num_calls, "response.completed"
    ]
    streamed = [json.loads(item["arguments"]) for item in events[-1]["response"]["output"]]
    assert streamed == [json.loads(item["arguments"]) for item in response["output"]]
    assert len({item["call_id"] for item in events[-1]["response"]["output"]}) == num_calls
