"""The gateway against a scripted engine: response shapes, streaming, stop strings, limits, and
every way the engine can fail underneath a request."""

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from ember_proto import StructuredOutputs
from tests.gateway.api.test_validation import assert_openai_error
from tests.gateway.conftest import Gateway, StartGateway, parse_sse, wait_until_async
from tests.gateway.fake_engine import FakeEngine, byte_tokenizer_spec
from tests.processes import free_port

MODEL = "fake-model"
REPLY = "Hello, world! ünïcödé €uro"  # the fake engine's answer, one byte-token per step


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def streamed_text(events: list[Any], key: str = "text") -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            piece = choice[key] if key == "text" else choice["delta"].get("content", "")
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


async def test_completion_shape(gateway: Gateway):
    status, body = await gateway.post("/v1/completions", completion(max_tokens=5))
    assert status == 200
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


async def test_chat_shape(gateway: Gateway):
    status, body = await gateway.post("/v1/chat/completions", chat(max_tokens=5))
    assert status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello", "refusal": None}, "logprobs": None,
         "finish_reason": "length"}
    ]
    assert body["usage"]["completion_tokens"] == 5


async def test_chat_content_parts_and_chat_template(gateway: Gateway, fake_engine: FakeEngine):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    status, _ = await gateway.post("/v1/chat/completions", chat(messages=messages, max_tokens=1))
    assert status == 200
    prompt = fake_engine.tokenizer.decode(fake_engine.received[-1].prompt_token_ids)
    assert prompt == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"


async def test_chat_prompt_options_developer_role_and_open_final_message(gateway: Gateway, fake_engine: FakeEngine):
    async def prompt_of(**fields: Any) -> str:
        status, body = await gateway.post("/v1/chat/completions", chat(max_tokens=1, **fields))
        assert status == 200, body
        return fake_engine.tokenizer.decode(fake_engine.received[-1].prompt_token_ids)

    user = {"role": "user", "content": "hi"}
    assert await prompt_of(messages=[{"role": "developer", "content": "be brief"}, user]) == await prompt_of(
        messages=[{"role": "system", "content": "be brief"}, user]
    )
    assert await prompt_of(messages=[user], add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    started = [user, {"role": "assistant", "content": "Once upon"}]
    assert await prompt_of(messages=started, add_generation_prompt=False, continue_final_message=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon"
    )
    for fields, param in [
        ({"messages": started, "continue_final_message": True}, "continue_final_message"),
        ({"messages": [user], "add_generation_prompt": False, "continue_final_message": True}, "messages"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "system"}, user]}, "messages[0].content"),
    ]:
        status, body = await gateway.post("/v1/chat/completions", chat(max_tokens=1, **fields))
        assert assert_openai_error(status, body, 400)["param"] == param, fields


async def test_completion_stream_equals_non_stream_and_include_usage(gateway: Gateway):
    body = completion(max_tokens=len(REPLY.encode()))
    _, whole = await gateway.post("/v1/completions", body)
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = await gateway.stream("/v1/completions", stream_body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(chunk["usage"] is None and chunk["object"] == "text_completion" for chunk in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert streamed_text(events[:-1] + ["[DONE]"]) == {0: REPLY} == {0: whole["choices"][0]["text"]}
    # characters are never split: every chunk is whole UTF-8 text
    assert len(chunks) > 10 and all(chunk["choices"][0]["text"] for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_role_chunk_content_and_finish_chunk(gateway: Gateway):
    events = await gateway.stream("/v1/chat/completions", chat(max_tokens=5, stream=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" and "usage" not in chunk for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == "Hello"
    assert chunks[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]


async def test_stream_with_several_choices(gateway: Gateway):
    events = await gateway.stream("/v1/chat/completions", chat(max_tokens=3, n=2, stream=True))
    chunks = events[:-1]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert streamed_text(events, key="delta") == {0: "Hel", 1: "Hel"}
    finished = [choice for chunk in chunks for choice in chunk["choices"] if choice["finish_reason"]]
    assert sorted((choice["index"], choice["finish_reason"]) for choice in finished) == [(0, "length"), (1, "length")]


async def test_stop_string_across_tokens_aborts_the_engine_request(gateway: Gateway, fake_engine: FakeEngine):
    status, body = await gateway.post("/v1/completions", completion(max_tokens=40, stop=["xyz", "world"]))
    assert status == 200
    assert body["choices"][0]["text"] == "Hello, " and body["choices"][0]["finish_reason"] == "stop"
    request_id = fake_engine.received[-1].request_id
    await wait_until_async(lambda: request_id in fake_engine.aborted, 2.0, "the Abort")
    assert body["usage"]["completion_tokens"] == len("Hello, world")

    events = await gateway.stream("/v1/chat/completions", chat(max_tokens=40, stop="ö", stream=True))
    assert streamed_text(events, key="delta") == {0: "Hello, world! ünïc"}
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_stop_token_ids_end_with_stop_and_leave_out_the_stop_token_text(gateway: Gateway, fake_engine: FakeEngine):
    comma = fake_engine.tokenizer.encode(",")[0]
    _, body = await gateway.post("/v1/completions", completion(max_tokens=40, stop_token_ids=[comma]))
    assert body["choices"][0] == {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == len("Hello,")
    events = await gateway.stream("/v1/completions", completion(max_tokens=40, stop_token_ids=[comma], stream=True))
    assert streamed_text(events) == {0: "Hello"}
    request = completion(max_tokens=40, stop_token_ids=[comma], include_stop_str_in_output=True)
    _, body = await gateway.post("/v1/completions", request)
    assert body["choices"][0]["text"] == "Hello,"


async def test_include_stop_str_in_output_keeps_the_stop_string(gateway: Gateway, fake_engine: FakeEngine):
    _, body = await gateway.post("/v1/completions", completion(max_tokens=40, stop=["world"], include_stop_str_in_output=True))
    assert body["choices"][0]["text"] == "Hello, world" and body["choices"][0]["finish_reason"] == "stop"


async def test_skip_special_tokens_false_keeps_control_tokens_text(replying, start_gateway: StartGateway):
    engine = await replying("Hello <|im_start|>world")
    gateway = await start_gateway(engine)
    request = completion(max_tokens=len(engine.reply_ids))
    _, body = await gateway.post("/v1/completions", request)
    assert body["choices"][0]["text"] == "Hello world"
    _, body = await gateway.post("/v1/completions", {**request, "skip_special_tokens": False})
    assert body["choices"][0]["text"] == "Hello <|im_start|>world"


async def test_min_tokens_holds_back_stop_strings(gateway: Gateway, fake_engine: FakeEngine):
    # The fake engine writes "Hello, world! ...", one byte per token: the "l" of token 3 is too early.
    _, body = await gateway.post("/v1/completions", completion(max_tokens=40, stop=["l"], min_tokens=4))
    assert body["choices"][0]["text"] == "Hel" and body["usage"]["completion_tokens"] == 4


async def test_n_and_prompt_lists_index_choices_and_derive_seeds(gateway: Gateway, fake_engine: FakeEngine):
    status, body = await gateway.post("/v1/completions", completion(prompt=["ab", "cde"], n=2, seed=7, max_tokens=2))
    assert status == 200
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    received = fake_engine.received[-4:]
    assert [generate.sampling.seed for generate in received] == [7, 8, 7, 8]
    assert [len(generate.prompt_token_ids) for generate in received] == [2, 2, 3, 3]
    assert len({generate.request_id for generate in received}) == 4

    await gateway.post("/v1/completions", completion(n=3, max_tokens=1))
    assert [generate.sampling.seed for generate in fake_engine.received[-3:]] == [None, None, None]


async def test_sampling_fields_reach_the_engine(gateway: Gateway, fake_engine: FakeEngine):
    await gateway.post(
        "/v1/completions",
        completion(
            max_tokens=3, temperature=0, top_p=0.5, top_k=-1, min_p=0.1, ignore_eos=True, min_tokens=2, stop_token_ids=[7]
        ),
    )
    sampling = fake_engine.received[-1].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (3, 0.0, 0.5, 0)
    assert sampling.min_p == 0.1
    assert (sampling.ignore_eos, sampling.min_tokens, sampling.stop_token_ids) == (True, 2, [7])
    assert sampling.logprobs is None
    await gateway.post("/v1/chat/completions", chat())
    assert fake_engine.received[-1].sampling.max_tokens == 64 - len(fake_engine.received[-1].prompt_token_ids)


async def test_completion_logprobs_and_echo(gateway: Gateway, fake_engine: FakeEngine):
    _, body = await gateway.post("/v1/completions", completion(prompt="hi ", max_tokens=3, logprobs=2, echo=True))
    choice = body["choices"][0]
    assert choice["text"] == "hi Hel"
    # The echoed prompt's tokens come first, the first without a logprob (OpenAI's legacy shape).
    assert choice["logprobs"] == {
        "tokens": ["h", "i", " ", "H", "e", "l"],
        "token_logprobs": [None, -0.5, -0.5, -0.25, -0.25, -0.25],
        "top_logprobs": [
            None, {"i": -0.5, "h": -2.0}, {" ": -0.5, "i": -2.0},
            {"H": -0.25, "I": -1.5}, {"e": -0.25, "f": -1.5}, {"l": -0.25, "m": -1.5},
        ],
        "text_offset": [0, 1, 2, 3, 4, 5],
    }
    assert fake_engine.received[-1].sampling.logprobs == 2
    assert fake_engine.received[-1].sampling.prompt_logprobs == 2
    _, plain = await gateway.post("/v1/completions", completion(prompt="hi ", max_tokens=3, logprobs=2))
    assert plain["choices"][0]["logprobs"]["tokens"] == ["H", "e", "l"]
    assert fake_engine.received[-1].sampling.prompt_logprobs is None
    body = completion(prompt="hi ", max_tokens=3, logprobs=2, echo=True, stream=True)
    events = await gateway.stream("/v1/completions", body)
    assert streamed_text(events) == {0: "hi Hel"}
    streamed_offsets = [offset for event in events[:-1] for offset in event["choices"][0]["logprobs"]["text_offset"]]
    assert streamed_offsets == [0, 1, 2, 3, 4, 5]  # the prompt's with the first chunk
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5, -0.5, -0.25]
    # The echoed prompt keeps its special tokens, and so do its offsets.
    _, body = await gateway.post("/v1/completions", completion(prompt="<|im_start|>a", max_tokens=1, logprobs=0, echo=True))
    logprobs = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "<|im_start|>aH"
    assert logprobs["tokens"] == ["<|im_start|>", "a", "H"] and logprobs["text_offset"] == [0, 12, 13]


async def test_logprobs_of_partial_characters_are_bytes(gateway: Gateway):
    _, body = await gateway.post("/v1/completions", completion(max_tokens=len("Hello, world! ü".encode()), logprobs=0))
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"][-2:] == ["bytes:\\xc3", "bytes:\\xbc"]
    assert logprobs["top_logprobs"][0] == {"H": -0.25}
    assert logprobs["text_offset"][-3:] == [13, 14, 14]


async def test_chat_logprobs(gateway: Gateway, fake_engine: FakeEngine):
    _, body = await gateway.post("/v1/chat/completions", chat(max_tokens=2, logprobs=True, top_logprobs=1))
    h = {"token": "H", "logprob": -0.25, "bytes": [72]}
    e = {"token": "e", "logprob": -0.25, "bytes": [101]}
    assert body["choices"][0]["logprobs"] == {
        "content": [{**h, "top_logprobs": [h]}, {**e, "top_logprobs": [e]}],
        "refusal": None,
    }
    await gateway.post("/v1/chat/completions", chat(max_tokens=1, logprobs=True))
    assert fake_engine.received[-1].sampling.logprobs == 0


async def test_models_health_and_served_name(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, model_name="served/name")
    async with gateway.http.get("/v1/models") as response:
        models = await response.json()
    entry = {"id": "served/name", "object": "model", "created": 1700000000, "owned_by": "ember", "max_model_len": 64,
             "dtype": "bfloat16", "numerics": "fast", "kv_cache_dtype": None, "cpu_build": "avx512bf16", "parent": None}
    assert models == {"object": "list", "data": [entry]}
    async with gateway.http.get("/v1/models/served/name") as response:
        assert response.status == 200
    async with gateway.http.get("/v1/models/fake-model") as response:
        assert_openai_error(response.status, await response.json(), 404)
    status, _ = await gateway.post("/v1/completions", {**completion(max_tokens=1), "model": "served/name"})
    assert status == 200
    status, body = await gateway.post("/v1/completions", completion(max_tokens=1))
    assert_openai_error(status, body, 404)
    async with gateway.http.get("/health") as response:
        assert response.status == 200 and (await response.json())["status"] == "ok"


async def test_metrics(gateway: Gateway):
    await gateway.post("/v1/completions", completion(max_tokens=4))
    await gateway.post("/v1/completions", completion(max_tokens=40, stop="o"))
    async with gateway.http.get("/metrics") as response:
        assert response.status == 200
        text = await response.text()
    label = 'model_name="fake-model"'
    engine_label = f'engine="{gateway.client.address}",{label}'
    for line in (
        f"ember_prompt_tokens_total{{{label}}} 10.0",
        f"ember_generation_tokens_total{{{label}}} 9.0",
        f'ember_request_success_total{{finished_reason="length",{label}}} 1.0',
        f'ember_request_success_total{{finished_reason="stop",{label}}} 1.0',
        f"ember_time_to_first_token_seconds_count{{{label}}} 2.0",
        f"ember_e2e_request_latency_seconds_count{{{label}}} 2.0",
        f"ember_request_queue_time_seconds_count{{{label}}} 2.0",
        f"ember_inter_token_latency_seconds_count{{{label}}} 7.0",
        f"ember_num_preemptions_total{{{engine_label}}} 3.0",
        f'ember_num_preemptions_by_priority_total{{{engine_label},priority="5"}} 1.0',
        f'ember_num_preemptions_by_priority_total{{{engine_label},priority="0"}} 2.0',
        f"ember_prefix_cache_queries_total{{{engine_label}}} 64.0",
        f"ember_prefix_cache_hits_total{{{engine_label}}} 48.0",
        f"ember_num_requests_running{{{engine_label}}} ",
        f"ember_num_requests_waiting{{{engine_label}}} 0.0",
        f"ember_num_queued_prefill_tokens{{{engine_label}}} 0.0",
        f"ember_kv_cache_usage_perc{{{engine_label}}} ",
        'ember_routing_decisions_total{reason="prefix"} 0.0',
        "ember_request_migrations_total 0.0",
        (
            f'ember_model_info{{cpu_build="avx512bf16",dtype="bfloat16",engine="{gateway.client.address}",'
            f'kv_cache_dtype="",{label},numerics="fast"}} 1.0'
        ),
    ):
        assert line in text, line


async def test_too_many_pending_gets_429(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, max_pending=2)
    fake_engine.step_interval = 0.05
    long_request = asyncio.create_task(gateway.post("/v1/completions", completion(n=2, max_tokens=20)))
    await wait_until_async(lambda: fake_engine.num_running == 2, 5.0, "two requests running")
    async with gateway.http.post("/v1/completions", json=completion(max_tokens=1)) as response:
        assert_openai_error(response.status, await response.json(), 429)
        assert response.headers["Retry-After"] == "1"
    status, body = await gateway.post("/v1/completions", completion(n=3, max_tokens=1))
    assert_openai_error(status, body, 400)  # could never fit
    assert (await long_request)[0] == 200
    status, _ = await gateway.post("/v1/completions", completion(max_tokens=1))
    assert status == 200


async def test_client_disconnect_mid_stream_aborts(fake_engine: FakeEngine, gateway: Gateway):
    fake_engine.step_interval = 0.05
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{gateway.url}/v1/completions", json=completion(max_tokens=40, stream=True))
        await response.content.readuntil(b"\n\n")
        response.close()  # drops the connection
    request_id = fake_engine.received[-1].request_id
    await wait_until_async(lambda: request_id in fake_engine.aborted, 2.0, "the Abort after the disconnect")
    assert gateway.client.num_in_flight == 0 and fake_engine.num_running == 0


async def test_client_disconnect_while_waiting_non_stream_aborts(fake_engine: FakeEngine, gateway: Gateway):
    fake_engine.step_interval = 0.05
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(f"{gateway.url}/v1/completions", json=completion(max_tokens=40)))
        await wait_until_async(lambda: fake_engine.num_running == 1, 5.0, "the request running")
        request.cancel()
    request_id = fake_engine.received[-1].request_id
    await wait_until_async(lambda: request_id in fake_engine.aborted, 2.0, "the Abort after the disconnect")


async def test_request_timeout(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, request_timeout=0.3)
    fake_engine.step_interval = 0.05
    started = time.monotonic()
    status, body = await gateway.post("/v1/completions", completion(max_tokens=40))
    assert_openai_error(status, body, 504)
    assert time.monotonic() - started < 2.0
    generate = fake_engine.received[-1]
    assert generate.deadline is not None and generate.deadline - generate.arrival_time == pytest.approx(0.3, abs=0.05)
    await wait_until_async(lambda: generate.request_id in fake_engine.aborted, 2.0, "the Abort at the deadline")

    events = await gateway.stream("/v1/completions", completion(max_tokens=40, stream=True))
    assert events[-2]["error"]["code"] == "request_timeout" and events[-1] == "[DONE]"


async def test_errors_are_counted_by_status_in_streams_too(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, request_timeout=0.3)
    fake_engine.step_interval = 0.05
    status, _ = await gateway.post("/v1/completions", completion(max_tokens=-1))
    assert status == 400
    status, _ = await gateway.post("/v1/completions", completion(max_tokens=40))
    assert status == 504
    events = await gateway.stream("/v1/completions", completion(max_tokens=40, stream=True))
    assert events[-2]["error"]["code"] == "request_timeout"  # after the stream's 200
    async with gateway.http.get("/health") as response:
        assert response.status == 200
    async with gateway.http.get("/metrics") as response:
        text = await response.text()
    assert 'ember_request_errors_total{status="400"} 1.0' in text
    assert 'ember_request_errors_total{status="504"} 2.0' in text


@pytest.mark.parametrize("code", [400, 503, 500])
async def test_engine_rejection_becomes_the_http_status(gateway: Gateway, fake_engine: FakeEngine, code: int):
    fake_engine.reject_code = code
    status, body = await gateway.post("/v1/completions", completion(stream=True))
    assert assert_openai_error(status, body, code)["message"] == "rejected by the fake engine"
    if code == 503:  # the gateway said Hello again and got Ready back
        await wait_until_async(lambda: fake_engine.hellos >= 2 and gateway.client.ready, 5.0, "ready again")
    fake_engine.reject_code = None
    status, _ = await gateway.post("/v1/completions", completion(max_tokens=1))
    assert status == 200


async def get_status(gateway: Gateway, path: str) -> int:
    async with gateway.http.get(path) as response:
        return response.status


@pytest.mark.parametrize("resume_wait", [0.0, 1.0])
async def test_engine_death_mid_stream_ends_every_request_then_recovers(
    fake_engine: FakeEngine, start_gateway: StartGateway, resume_wait: float
):
    """At once by default; after --engine-resume-wait when no engine comes back to resume them."""
    gateway = await start_gateway(fake_engine, engine_resume_wait=resume_wait)
    fake_engine.step_interval = 0.05
    async with gateway.http.post("/v1/chat/completions", json=chat(max_tokens=40, stream=True)) as stream:
        waiting = asyncio.create_task(gateway.post("/v1/completions", completion(max_tokens=40)))
        await stream.content.readuntil(b"\n\n")
        await wait_until_async(lambda: fake_engine.num_running == 2, 5.0, "both requests running")
        await fake_engine.stop()
        if resume_wait:
            await asyncio.sleep(resume_wait / 2)
            assert not waiting.done()
        events = parse_sse((await asyncio.wait_for(stream.read(), 5.0)).decode())
    assert events[-2]["error"]["type"] == "service_unavailable_error" and events[-1] == "[DONE]"
    status, body = await asyncio.wait_for(waiting, 5.0)
    message = assert_openai_error(status, body, 503)["message"]
    assert ("none came back within 1 s" if resume_wait else "lost the connection") in message
    async with gateway.http.get("/metrics") as response:  # the dead engine's gauges are not reported
        assert "ember_num_requests_running{" not in await response.text()
    assert await get_status(gateway, "/health") == 503
    status, body = await gateway.post("/v1/completions", completion())
    assert_openai_error(status, body, 503)

    restarted = FakeEngine(fake_engine.address)
    await restarted.start()
    try:
        await wait_until_async(lambda: gateway.client.ready, 5.0, "ready with the new engine")
        assert await get_status(gateway, "/health") == 200
        status, _ = await gateway.post("/v1/completions", completion(max_tokens=2))
        assert status == 200
        async with gateway.http.get("/metrics") as response:  # reported again once an engine is back
            assert "ember_num_requests_running{" in await response.text()
    finally:
        await restarted.stop()


async def test_engine_death_mid_stream_requests_resume_on_the_restarted_engine_with_engine_resume_wait(
    fake_engine: FakeEngine, start_gateway: StartGateway
):
    gateway = await start_gateway(fake_engine, engine_resume_wait=5.0)
    fake_engine.step_interval = 0.05
    expected = await gateway.post("/v1/completions", completion(max_tokens=24, logprobs=1, echo=True))
    async with gateway.http.post("/v1/chat/completions", json=chat(max_tokens=24, stream=True)) as stream:
        waiting = asyncio.create_task(gateway.post("/v1/completions", completion(max_tokens=24, logprobs=1, echo=True)))
        await stream.content.readuntil(b"\n\n")
        await wait_until_async(lambda: fake_engine.num_running == 2, 5.0, "both requests running")
        await asyncio.sleep(0.2)
        await fake_engine.stop()
        # the loss arrives as the socket's disconnect event, a moment later on a busy machine
        await wait_until_async(lambda: not gateway.client.ready, 5.0, "the engine's loss noticed")
        assert await get_status(gateway, "/health") == 503
        status, body = await gateway.post("/v1/completions", completion())  # a new request still gets its 503
        assert_openai_error(status, body, 503)

        restarted = FakeEngine(fake_engine.address, step_interval=0.05)
        await restarted.start()
        try:
            events = parse_sse((await asyncio.wait_for(stream.read(), 5.0)).decode())
            status, body = await asyncio.wait_for(waiting, 5.0)
        finally:
            await restarted.stop()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(event["choices"][0]["delta"].get("content", "") for event in events[:-1])
    assert text == expected[1]["choices"][0]["text"].removeprefix("hello")
    assert status == 200 and body == {**expected[1], "id": body["id"], "created": body["created"]}
    # each went on after the tokens it had, without asking again for the prompt's logprobs it had
    resumed = {generate.request_id: generate for generate in restarted.received}
    assert len(resumed) == 2 and all(0 < len(g.output_token_ids) < 24 for g in resumed.values())
    assert all(g.sampling.prompt_logprobs is None for g in resumed.values())


async def test_a_stopping_gateway_fails_the_requests_waiting_for_an_engine_at_once(
    fake_engine: FakeEngine, start_gateway: StartGateway
):
    """As when `ember serve` gives up restarting its engine: nothing will resume them."""
    gateway = await start_gateway(fake_engine, engine_resume_wait=60.0)
    fake_engine.step_interval = 0.05
    request = asyncio.create_task(gateway.post("/v1/completions", completion(max_tokens=40)))
    await wait_until_async(lambda: fake_engine.num_running == 1, 5.0, "the request running")
    await fake_engine.stop()
    await wait_until_async(lambda: not gateway.client.ready, 5.0, "the engine lost")
    gateway.pool.stop_resuming("the gateway is shutting down")
    status, body = await asyncio.wait_for(request, 2.0)
    error = assert_openai_error(status, body, 503)
    assert error["code"] == "engine_unavailable" and "shutting down" in error["message"]


@pytest.mark.parametrize("comeback", ["the same engine", "another model"])
async def test_requests_of_a_lost_engine_fail_on_an_engine_that_cannot_resume_them(
    fake_engine: FakeEngine, start_gateway: StartGateway, comeback: str
):
    """An engine answering under its old id may still hold them; another model cannot go on with them."""
    gateway = await start_gateway(fake_engine, engine_resume_wait=5.0)
    fake_engine.step_interval = 0.05
    request = asyncio.create_task(gateway.post("/v1/completions", completion(max_tokens=40)))
    await wait_until_async(lambda: fake_engine.num_running == 1, 5.0, "the request running")
    await fake_engine.stop()
    same = comeback == "the same engine"
    restarted = FakeEngine(fake_engine.address, **({"engine_id": fake_engine.engine_id} if same else {"vocab_size": 301}))
    await restarted.start()
    try:
        status, body = await asyncio.wait_for(request, 5.0)
        message = assert_openai_error(status, body, 503)["message"]
        assert ("stopped answering" if same else "another model") in message and restarted.received == []
        status, _ = await gateway.post("/v1/completions", completion(max_tokens=2))
        assert status == 200
    finally:
        await restarted.stop()


async def test_silent_engine_trips_the_watchdog(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, watchdog_s=0.5)
    fake_engine.step_interval = 0.05
    request = asyncio.create_task(gateway.post("/v1/completions", completion(max_tokens=40)))
    await wait_until_async(lambda: fake_engine.num_running == 1, 5.0, "the request running")
    fake_engine.paused = True
    status, body = await asyncio.wait_for(request, 5.0)
    assert_openai_error(status, body, 503)
    assert await get_status(gateway, "/health") == 503
    fake_engine.paused = False
    await wait_until_async(lambda: gateway.client.ready, 10.0, "ready once the engine answers again")


async def test_new_engine_id_fails_requests_in_flight(fake_engine: FakeEngine, gateway: Gateway):
    fake_engine.step_interval = 0.05
    request = asyncio.create_task(gateway.post("/v1/completions", completion(max_tokens=40)))
    await wait_until_async(lambda: fake_engine.num_running == 1, 5.0, "the request running")
    fake_engine.restart_in_place()
    status, body = await asyncio.wait_for(request, 5.0)
    assert_openai_error(status, body, 503)
    await wait_until_async(lambda: gateway.client.ready, 5.0, "ready with the new engine id")
    assert gateway.client.model is not None and gateway.client.model.engine_id == fake_engine.engine_id


async def test_new_engine_id_resumes_requests_in_flight_with_engine_resume_wait(
    fake_engine: FakeEngine, start_gateway: StartGateway
):
    gateway = await start_gateway(fake_engine, engine_resume_wait=5.0)
    fake_engine.step_interval = 0.05
    _, expected = await gateway.post("/v1/completions", completion(max_tokens=20))
    request = asyncio.create_task(gateway.post("/v1/completions", completion(max_tokens=20)))
    await wait_until_async(lambda: fake_engine.num_running == 1, 5.0, "the request running")
    await asyncio.sleep(0.2)
    fake_engine.restart_in_place()
    status, body = await asyncio.wait_for(request, 5.0)
    assert status == 200 and body["choices"] == expected["choices"]
    assert 0 < len(fake_engine.received[-1].output_token_ids) < 20
    assert gateway.client.model is not None and gateway.client.model.engine_id == fake_engine.engine_id


async def test_protocol_mismatch_stays_not_ready(start_gateway: StartGateway):
    engine = FakeEngine(f"tcp://127.0.0.1:{free_port()}", protocol_version=99)
    await engine.start()
    try:
        gateway = await start_gateway(engine, wait_ready=False)
        await wait_until_async(lambda: engine.hellos >= 2, 5.0, "repeated Hellos")
        assert not gateway.client.ready
        assert await get_status(gateway, "/health") == 503
        status, body = await gateway.post("/v1/completions", completion())
        assert_openai_error(status, body, 503)
    finally:
        await engine.stop()


async def test_no_engine_yet_is_503_everywhere_once_the_wait_for_one_is_over(start_gateway: StartGateway):
    gateway = await start_gateway(FakeEngine(f"tcp://127.0.0.1:{free_port()}"), wait_ready=False, engine_wait=0.3)
    assert await get_status(gateway, "/health") == 503
    started = time.monotonic()
    assert await get_status(gateway, "/v1/models") == 503
    assert time.monotonic() - started >= 0.3
    status, body = await gateway.post("/v1/chat/completions", chat())
    assert_openai_error(status, body, 503)


async def test_a_request_sent_before_the_engine_is_ready_waits_for_it(start_gateway: StartGateway):
    """As after `ember serve` restarts a gateway: requests queue until the engine answers its Hello."""
    engine = FakeEngine(f"tcp://127.0.0.1:{free_port()}")
    gateway = await start_gateway(engine, wait_ready=False, engine_wait=10.0)
    request = asyncio.ensure_future(gateway.post("/v1/completions", completion(max_tokens=3)))
    models = asyncio.ensure_future(get_status(gateway, "/v1/models"))
    await asyncio.sleep(0.5)
    assert not request.done() and await get_status(gateway, "/health") == 503
    await engine.start()
    try:
        status, body = await request
        assert status == 200 and body["choices"][0]["text"] == "Hel"
        assert await models == 200
    finally:
        await engine.stop()


async def test_model_without_tokenizer_serves_token_ids_only(start_gateway: StartGateway):
    engine = FakeEngine(f"tcp://127.0.0.1:{free_port()}", tokenizer_spec=None)
    await engine.start()
    try:
        gateway = await start_gateway(engine)
        for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
            status, error = await gateway.post(path, body)
            assert "tokenizer" in assert_openai_error(status, error, 400)["message"]
        status, error = await gateway.post("/v1/completions", completion(prompt=[1, 2], stop="x"))
        assert_openai_error(status, error, 400)
        status, body = await gateway.post(
            "/v1/completions", completion(prompt=[1, 2], max_tokens=3, logprobs=0, return_token_ids=True)
        )
        assert status == 200
        choice = body["choices"][0]
        assert choice["text"] == "" and choice["token_ids"] == [1, 2, 3]
        assert choice["logprobs"]["tokens"] == ["token_id:1", "token_id:2", "token_id:3"]
    finally:
        await engine.stop()


async def test_model_without_chat_template_refuses_chat(start_gateway: StartGateway):
    engine = FakeEngine(f"tcp://127.0.0.1:{free_port()}", tokenizer_spec=byte_tokenizer_spec(chat_template=None))
    await engine.start()
    try:
        gateway = await start_gateway(engine)
        status, error = await gateway.post("/v1/chat/completions", chat())
        assert "chat template" in assert_openai_error(status, error, 400)["message"]
        status, _ = await gateway.post("/v1/completions", completion(max_tokens=1))
        assert status == 200
    finally:
        await engine.stop()


async def test_cors_preflight_and_headers_let_browsers_call_the_api(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, api_key="sekret")  # a preflight carries no credentials
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    async with gateway.http.options("/v1/chat/completions", headers=preflight) as response:
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in response.headers["Access-Control-Allow-Methods"]
        assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    headers = {"Origin": "https://app.example", "Authorization": "Bearer sekret"}
    async with gateway.http.post("/v1/completions", json=completion(max_tokens=2), headers=headers) as response:
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == "*"
    async with gateway.http.post("/v1/completions", json=completion(max_tokens=2, stream=True), headers=headers) as response:
        assert response.headers["Access-Control-Allow-Origin"] == "*"  # set before a stream's headers go out
        await response.read()


@pytest.mark.parametrize("api_key", [None, "sekret"])
async def test_cors_limited_to_the_allowed_origins(
    fake_engine: FakeEngine, start_gateway: StartGateway, api_key: str | None
):
    gateway = await start_gateway(fake_engine, allowed_origins=("https://app.example",), api_key=api_key)
    if api_key:
        gateway.http.headers["Authorization"] = f"Bearer {api_key}"
    async with gateway.http.get("/v1/models", headers={"Origin": "https://app.example"}) as response:
        assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert response.headers["Vary"] == "Origin"
    async with gateway.http.get("/v1/models", headers={"Origin": "https://evil.example"}) as response:
        assert "Access-Control-Allow-Origin" not in response.headers
        assert response.headers["Vary"] == "Origin"  # a shared cache must not hand this to another origin
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    async with gateway.http.options("/v1/completions", headers=preflight, auth=None) as response:
        # never a 401: a preflight carries no credentials, with or without an API key
        assert response.status == 405 and "Access-Control-Allow-Origin" not in response.headers


async def test_every_way_of_asking_for_a_constraint_reaches_the_engine_as_one(gateway: Gateway, fake_engine: FakeEngine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for path, body, expected in [
        ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
         StructuredOutputs(json=json.dumps(schema))),
        ("/v1/chat/completions", chat(response_format={"type": "json_object"}), StructuredOutputs(json_object=True)),
        ("/v1/completions", completion(structured_outputs={"regex": "[a-z]+"}), StructuredOutputs(regex="[a-z]+")),
        ("/v1/completions", completion(guided_json=json.dumps(schema)), StructuredOutputs(json=json.dumps(schema))),
        ("/v1/completions", completion(guided_choice=["yes", "no"]), StructuredOutputs(choice=["yes", "no"])),
        ("/v1/chat/completions", chat(guided_grammar='root ::= "x"'), StructuredOutputs(grammar='root ::= "x"')),
        ("/v1/chat/completions", chat(response_format={"type": "text"}), None),
        ("/v1/chat/completions",
         chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}),
         StructuredOutputs(json=json.dumps({**schema, "additionalProperties": False}))),
        ("/v1/chat/completions", chat(response_format={"type": "json_object"}, json_any_whitespace=True),
         StructuredOutputs(json_object=True, any_whitespace=True)),
    ]:
        status, _ = await gateway.post(path, body)
        assert status == 200 and fake_engine.received[-1].sampling.structured_outputs == expected, body


async def test_priority_reaches_the_engine_and_must_be_an_integer(gateway: Gateway, fake_engine: FakeEngine):
    for path, body in (("/v1/chat/completions", chat(priority=-3)), ("/v1/completions", completion(priority=7))):
        status, _ = await gateway.post(path, body)
        assert status == 200 and fake_engine.received[-1].sampling.priority == body["priority"]
    status, body = await gateway.post("/v1/completions", completion(priority="high"))
    assert_openai_error(status, body, 400)
    assert body["error"]["param"] == "priority"
