"""Malformed requests: each gets the right 4xx with an OpenAI error body, and the gateway keeps serving."""

import gzip
import json
import sys
import zlib
from typing import Any

import brotli
import pytest

if sys.version_info >= (3, 14):
    from compression import zstd
else:
    from backports import zstd

from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_engine import FakeEngine

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": "fake-model", "prompt": "hello", **fields}).encode()


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def raw(value: Any) -> bytes:
    return json.dumps(value).encode()


# (path, body, status, param); param None: not checked
CORPUS: list[tuple[str, bytes, int, str | None]] = [
    (COMPLETIONS, b"{not json", 400, None),
    (COMPLETIONS, b"", 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, b'"a string"', 400, None),
    (COMPLETIONS, b"null", 400, None),
    (COMPLETIONS, b'{"model": "fake-model", "prompt": "hi", "x": ' + b"[" * 10000 + b"]" * 10000 + b"}", 400, None),
    (CHAT, b'{"model": "fake-model", "messages": ' + b'{"a":' * 100000 + b"1" + b"}" * 100000 + b"}", 400, None),
    (COMPLETIONS, raw({"prompt": "hi"}), 400, "model"),
    (COMPLETIONS, raw({"model": "fake-model"}), 400, "prompt"),
    (COMPLETIONS, raw({"model": 5, "prompt": "hi"}), 400, "model"),
    (COMPLETIONS, raw({"model": "no-such-model", "prompt": "hi"}), 404, "model"),
    (COMPLETIONS, completion(prompt=""), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[[]]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=["a", 1]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[1, [2]]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[True]), 400, None),
    (COMPLETIONS, completion(prompt={"text": "hi"}), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[-1]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[300]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[[1, 2], [3, 3000]]), 400, "prompt"),
    (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=1.5), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=True), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=60), 400, "max_tokens"),  # 5 prompt tokens + 60 > 64
    (COMPLETIONS, completion(max_tokens=10**30), 400, "max_tokens"),
    (COMPLETIONS, completion(temperature=-0.1), 400, "temperature"),
    (COMPLETIONS, completion(temperature=2.5), 400, "temperature"),
    (COMPLETIONS, completion(temperature="hot"), 400, "temperature"),
    (COMPLETIONS, completion(top_p=-0.1), 400, "top_p"),
    (COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    (COMPLETIONS, completion(top_k=-2), 400, "top_k"),
    (COMPLETIONS, completion(min_p=1.5), 400, "min_p"),
    (CHAT, chat(min_p=-0.1), 400, "min_p"),
    (COMPLETIONS, completion(n=0), 400, "n"),
    (COMPLETIONS, completion(n=100000), 400, "n"),
    (COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    (COMPLETIONS, completion(logprobs=-1), 400, "logprobs"),
    (COMPLETIONS, completion(logprobs=True), 400, "logprobs"),
    (COMPLETIONS, completion(stop=""), 400, "stop"),
    (COMPLETIONS, completion(stop=["ok", ""]), 400, "stop"),
    (COMPLETIONS, completion(stop=[1]), 400, "stop[0]"),
    (COMPLETIONS, completion(stop=5), 400, "stop"),
    (COMPLETIONS, completion(stop=[str(i) for i in range(17)]), 400, "stop"),
    (COMPLETIONS, completion(seed=2**63), 400, "seed"),
    (COMPLETIONS, completion(top_k=2**63), 400, "top_k"),
    (COMPLETIONS, completion(seed="x"), 400, "seed"),
    (COMPLETIONS, completion(stream="yes"), 400, "stream"),
    (COMPLETIONS, completion(stream=True, stream_options={"include_usage": "x"}), 400, "stream_options.include_usage"),
    (COMPLETIONS, completion(echo="x"), 400, "echo"),
    (COMPLETIONS, completion(stop_token_ids=[999]), 400, "stop_token_ids"),
    (COMPLETIONS, completion(stop_token_ids=[-3]), 400, "stop_token_ids[0]"),
    (COMPLETIONS, completion(min_tokens=20), 400, "min_tokens"),  # > the default 16 max_tokens
    (COMPLETIONS, completion(ignore_eos="no"), 400, "ignore_eos"),
    (CHAT, raw({"model": "fake-model"}), 400, "messages"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages="hi"), 400, "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0].type"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages[0].content[0].text"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CHAT, chat(logprobs=1), 400, "logprobs"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens=1000), 400, "max_tokens"),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * 100}]), 400, "messages"),  # no room left
    (COMPLETIONS, completion(prompt="x" * 100, max_tokens=5), 400, "prompt"),  # the prompt alone is over the context
    (CHAT, raw({"model": "other", "messages": [{"role": "user", "content": "hi"}]}), 404, "model"),
    (COMPLETIONS, completion(presence_penalty=2.5), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    (COMPLETIONS, completion(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(logit_bias={"50": -101}), 400, "logit_bias[...]"),
    (CHAT, chat(logit_bias={"fifty": 1}), 400, "logit_bias"),
    (COMPLETIONS, completion(logit_bias={"300": 1}), 400, "logit_bias"),  # outside the fake vocabulary
    (COMPLETIONS, completion(prompt=[72, 280]), 400, "prompt"),  # in the model's 300 ids, not the tokenizer's 259
    (COMPLETIONS, completion(prompt=[72, 280], echo=True), 400, "prompt"),
    (COMPLETIONS, completion(stream_options={"include_usage": True}), 400, "stream_options"),  # without stream
    # OpenAI fields ember does not implement, at values that would change the output
    # output constraints that cannot be
    (CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": 5}}), 400, "response_format.json_schema"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}), 400,
     "response_format"),
    (COMPLETIONS, completion(guided_regex="(unclosed"), 400, "guided_regex"),
    (COMPLETIONS, completion(guided_json="{not json"), 400, "guided_json"),
    (CHAT, chat(guided_choice="yes"), 400, "guided_choice"),
    (CHAT, chat(guided_grammar="start: missing"), 400, "guided_grammar"),
    (CHAT, chat(structured_outputs={"regex": "a", "choice": ["a"]}), 400, "structured_outputs"),
    (CHAT, chat(structured_outputs={"choice": "a"}), 400, "structured_outputs.choice"),
    (CHAT, chat(structured_outputs=["a"]), 400, "structured_outputs"),
    (CHAT, chat(response_format={"type": "json_object"}, guided_regex="a"), 400, "guided_regex"),  # two at once
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tool_choice"),
    (CHAT, chat(function_call={"name": "f"}), 400, "function_call"),
    (CHAT, chat(tools="f"), 400, "tools"),  # ignored, but only when it is a list of tool objects
    (CHAT, chat(tools=["f"]), 400, "tools[0]"),
    (CHAT, chat(functions={"name": "f"}), 400, "functions"),
    (CHAT, chat(tool_choice="auto"), 400, "tool_choice"),  # without tools, as OpenAI and vLLM
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), 400, "tool_choice"),
    (CHAT, chat(tools=[{"type": "function", "function": {}}]), 400, "tools[0]"),
    (COMPLETIONS, completion(tool_choice="required"), 400, "tool_choice"),
    (CHAT, chat(function_call="none"), 400, "function_call"),
    (COMPLETIONS, completion(best_of=3), 400, "best_of"),
    (COMPLETIONS, completion(suffix="end"), 400, "suffix"),
    # vLLM's extensions ember does not implement
    (COMPLETIONS, completion(use_beam_search=True), 400, "use_beam_search"),
    (CHAT, chat(bad_words=["x"]), 400, "bad_words"),
    (COMPLETIONS, completion(allowed_token_ids=[72]), 400, "allowed_token_ids"),
    (COMPLETIONS, completion(prompt_logprobs=1), 400, "prompt_logprobs"),
    (CHAT, chat(truncate_prompt_tokens=5), 400, "truncate_prompt_tokens"),
    (CHAT, chat(echo=True), 400, "echo"),
    (CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    (CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
]


# What an error body must never carry: a stack, an OS error's text (host internals), a source line.
LEAKS = ("Traceback", "Errno", 'File "')


def assert_openai_error(status: int, body: Any, expected_status: int) -> dict[str, Any]:
    """Every error body the suite meets passes here: OpenAI's shape, and none of LEAKS."""
    assert status == expected_status, body
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert not [leak for leak in LEAKS if leak in json.dumps(body)], body
    return error


async def test_malformed_corpus_gets_4xx_each_and_good_requests_still_work(gateway: Gateway):
    for path, body, expected_status, param in CORPUS:
        async with gateway.http.post(path, data=body, headers={"Content-Type": "application/json"}) as response:
            error = assert_openai_error(response.status, await response.json(), expected_status)
        if param is not None:
            assert error["param"] == param, (path, body, error)
    status, good = await gateway.post(COMPLETIONS, {"model": "fake-model", "prompt": "hello", "max_tokens": 3})
    assert status == 200 and good["choices"][0]["text"] == "Hel"


async def test_context_length_error_states_the_numbers(gateway: Gateway):
    status, body = await gateway.post(COMPLETIONS, {"model": "fake-model", "prompt": "hello", "max_tokens": 60})
    message = assert_openai_error(status, body, 400)["message"]
    assert "64" in message and "65" in message and "60" in message


async def test_unknown_fields_and_unimplemented_ones_at_their_no_op_values_are_accepted(gateway: Gateway):
    status, body = await gateway.post(
        COMPLETIONS,
        {"model": "fake-model", "prompt": "hi", "max_tokens": 2, "user": "u1", "x": {"y": [1]}, "best_of": 2, "n": 2,
         "suffix": "", "logit_bias": {}, "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None,
         "seed": -1, "use_beam_search": False, "bad_words": [], "guided_json": None, "min_p": 0},
    )
    assert status == 200, body
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, body = await gateway.post(
        CHAT, json.loads(chat(max_tokens=2, tools=tools, tool_choice="none", response_format={"type": "text"}, modalities=["text"], audio=None))
    )
    assert status == 200, body


async def test_penalties_and_logit_bias_reach_the_engine(gateway: Gateway, fake_engine: FakeEngine):
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.3, "logit_bias": {"72": -100}}
    status, body = await gateway.post(CHAT, json.loads(chat(max_tokens=2, **fields)))
    assert status == 200, body
    sampling = fake_engine.received[-1].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.3)
    assert sampling.logit_bias == {72: -100.0}


async def test_unknown_route_and_wrong_method_get_json_errors(gateway: Gateway):
    async with gateway.http.get("/v1/nope") as response:
        assert_openai_error(response.status, await response.json(), 404)
    async with gateway.http.get(COMPLETIONS) as response:
        assert_openai_error(response.status, await response.json(), 405)
        assert response.headers["Allow"] == "POST"


COMPRESSORS = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress, "zstd": zstd.compress}


@pytest.mark.parametrize("encoding", COMPRESSORS)
async def test_compressed_bodies_are_read_and_a_body_that_is_not_what_its_encoding_says_gets_400(
    gateway: Gateway, encoding: str
):
    request = raw({"model": "fake-model", "prompt": "hello", "max_tokens": 3})
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    async with gateway.http.post(COMPLETIONS, data=COMPRESSORS[encoding](request), headers=headers) as response:
        assert response.status == 200 and (await response.json())["choices"][0]["text"] == "Hel"
    async with gateway.http.post(COMPLETIONS, data=request, headers=headers) as response:
        error = assert_openai_error(response.status, await response.json(), 400)
    assert error["message"].startswith("the request body could not be decoded")


async def test_a_body_in_an_unknown_content_encoding_gets_415(gateway: Gateway):
    request = raw({"model": "fake-model", "prompt": "hello", "max_tokens": 3})
    headers = {"Content-Type": "application/json", "Content-Encoding": "xz"}
    async with gateway.http.post(COMPLETIONS, data=request, headers=headers) as response:
        assert "'xz'" in assert_openai_error(response.status, await response.json(), 415)["message"]
    headers["Content-Encoding"] = "Identity"
    async with gateway.http.post(COMPLETIONS, data=request, headers=headers) as response:
        assert response.status == 200


@pytest.mark.parametrize("encoding", COMPRESSORS)
async def test_a_compressed_body_is_held_to_the_limit_once_decompressed(
    fake_engine: FakeEngine, start_gateway: StartGateway, encoding: str
):
    gateway = await start_gateway(fake_engine, max_body_bytes=2048)
    bomb = raw({"model": "fake-model", "prompt": "x" * 1_000_000})
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    async with gateway.http.post(COMPLETIONS, data=COMPRESSORS[encoding](bomb), headers=headers) as response:
        assert_openai_error(response.status, await response.json(), 413)


async def test_body_over_the_limit_gets_413(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, max_body_bytes=2048)
    status, body = await gateway.post(COMPLETIONS, {"model": "fake-model", "prompt": "x" * 4096})
    assert_openai_error(status, body, 413)
    status, _ = await gateway.post(COMPLETIONS, {"model": "fake-model", "prompt": "x", "max_tokens": 1})
    assert status == 200


async def test_api_key(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, api_key="sekret")
    good = {"model": "fake-model", "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}, {"Authorization": "Basic sekret"}):
        status, body = await gateway.post(COMPLETIONS, good, headers=headers)
        assert_openai_error(status, body, 401)
    async with gateway.http.get("/v1/models") as response:
        assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    for scheme in ("Bearer", "bearer", "BEARER"):  # case-insensitive, as RFC 9110 says
        status, _ = await gateway.post(COMPLETIONS, good, headers={"Authorization": f"{scheme} sekret"})
        assert status == 200
    for open_path in ("/health", "/metrics"):
        async with gateway.http.get(open_path) as response:
            assert response.status == 200


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_unexpected_exception_is_a_500_and_serving_continues(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, path: str
):
    from ember_gateway.api.completions import choices

    original = choices.build_choices
    monkeypatch.setattr("ember_gateway.api.completions.completions.build_choices", lambda *a, **k: 1 / 0)
    monkeypatch.setattr("ember_gateway.api.completions.chat.build_choices", lambda *a, **k: 1 / 0)
    body = json.loads(completion() if path == COMPLETIONS else chat())
    status, error = await gateway.post(path, body)
    assert assert_openai_error(status, error, 500)["type"] == "server_error"
    monkeypatch.setattr("ember_gateway.api.completions.completions.build_choices", original)
    monkeypatch.setattr("ember_gateway.api.completions.chat.build_choices", original)
    status, _ = await gateway.post(path, {**body, "max_tokens": 2})
    assert status == 200
