"""Tool calling in chat against a fake engine that answers with a given text: the calls read back,
streamed, constrained when forced, and a conversation holding calls and their results."""

from __future__ import annotations

import json
from typing import Any

from ember_gateway.tools import ToolPlan, parse_calls
from tests.gateway.conftest import Gateway, StartGateway

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# Llama 3.2's way with tools, shortened: the tools and the call format in the last user turn, calls
# as {"name", "parameters"} objects, results in ipython turns
LLAMA3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and loop.last and tools %}"
    "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
    'function call. Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}.\n\n{%- for tool in tools %}{{ tool | tojson }}\n\n{%- endfor %}{{ message.content }}<|eot_id|>"
    "{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)


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
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny.", "refusal": None}
    assert body["choices"][0]["finish_reason"] == "length"  # the engine's, as without tools


async def test_a_forced_stream_sends_the_calls_once_the_output_is_complete(replying, start_gateway: StartGateway):
    engine = await replying(json.dumps([CALL, {**CALL, "arguments": {"city": "Rome"}}]))
    gateway = await start_gateway(engine)
    request = chat(tool_choice="required", stream=True, max_tokens=len(engine.reply_ids))
    events = await gateway.stream("/v1/chat/completions", request)
    deltas = [event["choices"][0] for event in events[:-1] if event["choices"]]
    calls = [call for delta in deltas for call in delta["delta"].get("tool_calls", [])]
    assert [(c["index"], json.loads(c["function"]["arguments"])["city"]) for c in calls] == [(0, "Paris"), (1, "Rome")]
    assert deltas[-1]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"


async def test_a_stream_sends_content_as_it_comes_and_each_call_once_complete(replying, start_gateway: StartGateway):
    second = {**CALL, "arguments": {"city": "Rome"}}
    engine = await replying(f"Let me look.<tool_call>{json.dumps(CALL)}</tool_call><tool_call>{json.dumps(second)}</tool_call>")
    gateway = await start_gateway(engine)
    events = await gateway.stream("/v1/chat/completions", chat(stream=True, max_tokens=len(engine.reply_ids)))
    deltas = [event["choices"][0]["delta"] for event in events[:-1] if event["choices"]]
    contents = [delta["content"] for delta in deltas if delta.get("content")]
    assert "".join(contents) == "Let me look." and len(contents) > 1  # streamed, not held to the end
    entries = [(i, entry) for i, delta in enumerate(deltas) for entry in delta.get("tool_calls", [])]
    assert [entry["index"] for _, entry in entries] == [0, 1] and entries[0][0] < entries[1][0]  # one chunk each
    assert [json.loads(entry["function"]["arguments"]) for _, entry in entries] == [{"city": "Paris"}, {"city": "Rome"}]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    # a call cut short by max_tokens is content
    events = await gateway.stream("/v1/chat/completions", chat(stream=True, max_tokens=20))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == engine.reply_text[:20] and events[-2]["choices"][0]["finish_reason"] == "length"


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


async def test_a_llama_3_template_gets_the_tools_and_its_json_calls_are_read(replying, start_gateway: StartGateway):
    reply = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
    engine = await replying(reply, LLAMA3_TEMPLATE)
    gateway = await start_gateway(engine)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "user", "content": "And in Rome?"},
    ]
    status, body = await gateway.post("/v1/chat/completions", chat(messages=messages, max_tokens=len(engine.reply_ids)))
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Rome"}]
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert json.dumps(WEATHER) in prompt and "You can call these tools" not in prompt  # the template's own
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt  # arguments as an object
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n21 C" in prompt
    events = await gateway.stream("/v1/chat/completions", chat(stream=True, max_tokens=len(engine.reply_ids)))
    deltas = [event["choices"][0]["delta"] for event in events[:-1] if event["choices"]]
    assert not any(delta.get("content") for delta in deltas)  # held from its first "<": it may be a call
    assert [json.loads(c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])] == [{"city": "Rome"}]
    # Hermes blocks are not this family's syntax: text
    hermes = await start_gateway(await replying(f"<tool_call>{json.dumps(CALL)}</tool_call>", LLAMA3_TEMPLATE))
    status, body = await hermes.post("/v1/chat/completions", chat(max_tokens=60))
    assert "tool_calls" not in body["choices"][0]["message"]


def test_parsing_takes_llama_style_json_and_one_call_without_parallel_tool_calls() -> None:
    plan = ToolPlan([WEATHER], "auto", parallel=False, syntax="llama3_json")
    content, calls = parse_calls(plan, json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}, CALL]))
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}]
    assert parse_calls(plan, '{"answer": 42}') == ('{"answer": 42}', [])
