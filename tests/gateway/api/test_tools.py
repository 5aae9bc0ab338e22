"""Tool calling in chat against a fake engine that answers with a given text: the calls read back,
streamed, constrained when forced, and a conversation holding calls and their results; each model
family's call syntax chosen from its published chat template (tests/core/data/chat_templates)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ember_core.tokenizer import render_chat
from ember_gateway.api.completions.tools import (
    CallStream,
    ToolPlan,
    describe,
    parse_calls,
    tool_syntax,
    with_tool_description,
)
from tests.gateway.conftest import Gateway, StartGateway

TEMPLATES = Path(__file__).parents[2] / "core" / "data" / "chat_templates"

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
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    await gateway.post("/v1/chat/completions", chat(tools=[strict], tool_choice=named, max_tokens=len(engine.reply_ids)))
    arguments = json.loads(engine.received[-1].sampling.structured_outputs.json)["properties"]["arguments"]
    assert arguments == {**WEATHER["function"]["parameters"], "additionalProperties": False}


# A conversation whose assistant turn called get_weather and whose tool turn answered it.
ANSWERED_CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


async def test_a_conversation_with_calls_and_results_reaches_the_model_as_text(replying, start_gateway: StartGateway):
    engine = await replying("It is 21 degrees.")
    gateway: Gateway = await start_gateway(engine)
    messages = ANSWERED_CALL
    status, body = await gateway.post("/v1/chat/completions", chat(messages=messages, max_tokens=17))
    assert status == 200 and body["choices"][0]["message"]["content"] == "It is 21 degrees."
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert "get_weather" in prompt and '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<tool_response>21 C</tool_response>" in prompt


async def test_a_llama_3_template_gets_the_tools_and_its_json_calls_are_read(replying, start_gateway: StartGateway):
    reply = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
    engine = await replying(reply, LLAMA3_TEMPLATE)
    gateway = await start_gateway(engine)
    messages = [*ANSWERED_CALL, {"role": "user", "content": "And in Rome?"}]
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


def family_template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize(
    ("template_name", "syntax"),
    [
        ("qwen2.5-instruct.jinja", "hermes"),
        ("qwen3.jinja", "hermes"),
        ("mistral-7b-instruct-v0.3.jinja", "mistral"),
        # no tools in the template: described, asking for Hermes blocks
        ("gemma-2-it.jinja", "hermes"),
        ("gemma-3-it.jinja", "hermes"),
        ("phi-3.5-mini-instruct.jinja", "hermes"),
        ("phi-4.jinja", "hermes"),
        ("olmo-2-instruct.jinja", "hermes"),
    ],
)
def test_each_family_s_template_chooses_its_call_syntax(template_name: str, syntax: str) -> None:
    assert tool_syntax(family_template(template_name)) == syntax
    assert tool_syntax(LLAMA3_TEMPLATE) == "llama3_json"


@pytest.mark.parametrize("template_name", ["qwen2.5-instruct.jinja", "qwen3.jinja"])
async def test_a_qwen_template_renders_the_tools_itself_and_its_hermes_calls_are_read(
    template_name: str, replying, start_gateway: StartGateway
):
    engine = await replying(f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", family_template(template_name))
    gateway = await start_gateway(engine)
    messages = ANSWERED_CALL
    status, body = await gateway.post("/v1/chat/completions", chat(messages=messages, max_tokens=len(engine.reply_ids)))
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Paris"}]
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in prompt and "You can call these tools" not in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt  # an object
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>" in prompt


ROME = {"name": "get_weather", "arguments": {"city": "Rome"}}
# Mistral's two spellings: a JSON array (7B v0.3), or name[ARGS]arguments per call (newer tokenizers)
MISTRAL_REPLIES = [
    f"[TOOL_CALLS] {json.dumps([CALL, ROME])}",
    "".join(f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(call['arguments'])}" for call in (CALL, ROME)),
]


PARIS_AND_ROME = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def call_arguments(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


@pytest.mark.parametrize("reply", MISTRAL_REPLIES)
def test_mistral_calls_are_read_in_either_spelling(reply: str) -> None:
    plan = ToolPlan([WEATHER], "auto", parallel=True, syntax="mistral")
    content, calls = parse_calls(plan, reply)
    assert content is None and call_arguments(calls) == PARIS_AND_ROME
    assert all(re.fullmatch("[0-9a-z]{9}", call["id"]) for call in calls)  # the ids Mistral's template takes back
    content, calls = parse_calls(plan, f"Let me look. {reply}")
    assert content == "Let me look." and len(calls) == 2
    one_call = ToolPlan([WEATHER], "auto", parallel=False, syntax="mistral")
    assert call_arguments(parse_calls(one_call, reply)[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny.",
        '[TOOL_CALLS] [{"name": "get_weather", "argum',  # cut short
        "[TOOL_CALLS]get_weather",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time',
        '[TOOL_CALLS] {"answer": 42}',
        f"<tool_call>{json.dumps(CALL)}</tool_call>",  # Hermes blocks are not Mistral's syntax
    ],
)
def test_mistral_output_without_whole_calls_is_text(text: str) -> None:
    assert parse_calls(ToolPlan([WEATHER], "auto", parallel=True, syntax="mistral"), text) == (text, [])


def stream_in_pieces(plan: ToolPlan, text: str, size: int) -> tuple[list[str], list[Any], list[Any]]:
    """(content pieces as sent, call entries sent while the text came, call entries sent at the end)."""
    calls = CallStream(plan)
    contents, early = [], []
    for start in range(0, len(text), size):
        content, entries = calls.feed(text[start : start + size])
        contents.append(content)
        early += entries
    content, late = calls.finish()
    return [*contents, content], early, late


@pytest.mark.parametrize("reply", MISTRAL_REPLIES)
def test_a_mistral_stream_sends_content_up_to_the_calls_and_the_calls_at_the_end(reply: str) -> None:
    plan = ToolPlan([WEATHER], "auto", parallel=True, syntax="mistral")
    contents, early, late = stream_in_pieces(plan, f"Let me look [at] it.{reply}", 3)
    assert contents[0] == "Let" and contents[-1] == ""  # sent as it came, a "[" only while it may open the calls
    assert "".join(contents) == "Let me look [at] it."
    assert not early and [entry["index"] for entry in late] == [0, 1]
    assert call_arguments(late) == PARIS_AND_ROME
    cut_short = reply[: len(reply) // 2]
    contents, early, late = stream_in_pieces(plan, f"Hm.{cut_short}", 4)
    assert "".join(contents) == f"Hm.{cut_short}" and not early and not late


async def test_a_mistral_template_gets_the_tools_and_its_calls_come_back_with_ids_it_takes(
    replying, start_gateway: StartGateway
):
    # [TOOL_CALLS] is a control token in Mistral's vocabularies: its text is skipped unless asked for
    engine = await replying(MISTRAL_REPLIES[0], family_template("mistral-7b-instruct-v0.3.jinja"), ("[TOOL_CALLS]",))
    gateway = await start_gateway(engine)
    status, body = await gateway.post("/v1/chat/completions", chat(max_tokens=len(engine.reply_ids)))
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    paris, rome = choice["message"]["tool_calls"]
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert "[AVAILABLE_TOOLS] [" in prompt and "You can call these tools" not in prompt
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [paris, rome]},
        {"role": "tool", "tool_call_id": paris["id"], "content": "21 C"},
        {"role": "tool", "tool_call_id": rome["id"], "content": "25 C"},
    ]
    status, body = await gateway.post("/v1/chat/completions", chat(messages=messages, max_tokens=len(engine.reply_ids)))
    assert status == 200, body
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert f'{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{paris["id"]}"}}' in prompt
    assert f'[TOOL_RESULTS] {{"content": 25 C, "call_id": "{rome["id"]}"}}[/TOOL_RESULTS]' in prompt
    events = await gateway.stream("/v1/chat/completions", chat(stream=True, max_tokens=len(engine.reply_ids)))
    deltas = [event["choices"][0]["delta"] for event in events[:-1] if event["choices"]]
    assert not any(delta.get("content") for delta in deltas)
    assert call_arguments([call for delta in deltas for call in delta.get("tool_calls", [])]) == PARIS_AND_ROME
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


USER = {"role": "user", "content": "Weather in Paris?"}


def test_tools_described_for_gemma_2_go_in_the_first_user_turn_as_it_refuses_a_system_one() -> None:
    gemma2, plan = family_template("gemma-2-it.jinja"), ToolPlan([WEATHER], "auto", parallel=True)
    with pytest.raises(ValueError, match="System role not supported"):  # what a system message of them would meet
        render_chat(gemma2, [{"role": "system", "content": describe(plan)}, USER])
    prompt = render_chat(gemma2, with_tool_description(plan, [USER], gemma2))
    assert prompt == f"<start_of_turn>user\n{describe(plan)}\n\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ValueError, match="System role not supported"):  # the request's own is the template's to refuse
        render_chat(gemma2, with_tool_description(plan, [{"role": "system", "content": "Be terse."}, USER], gemma2))


def test_tools_described_for_other_templates_join_the_system_message() -> None:
    plan = ToolPlan([WEATHER], "auto", parallel=True)
    system = {"role": "system", "content": "Be terse."}
    gemma3 = family_template("gemma-3-it.jinja")
    with pytest.raises(ValueError, match="must alternate"):  # Gemma 3 folds in one system message, not two
        render_chat(gemma3, [{"role": "system", "content": describe(plan)}, system, USER])
    prompt = render_chat(gemma3, with_tool_description(plan, [system, USER], gemma3))
    assert prompt == (
        f"<start_of_turn>user\nBe terse.\n\n{describe(plan)}\n\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\n"
    )
    phi = family_template("phi-3.5-mini-instruct.jinja")
    assert with_tool_description(plan, [USER], phi) == [{"role": "system", "content": describe(plan)}, USER]



async def test_a_gemma_2_template_gets_the_tools_in_the_first_user_turn(replying, start_gateway: StartGateway):
    engine = await replying(f"<tool_call>{json.dumps(CALL)}</tool_call>", family_template("gemma-2-it.jinja"))
    gateway = await start_gateway(engine)
    status, body = await gateway.post("/v1/chat/completions", chat(max_tokens=len(engine.reply_ids)))
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert prompt.startswith("<start_of_turn>user\nYou can call these tools")
    assert prompt.endswith("\n\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\n")
