"""Real processes: an engine worker on a tiny random GPT-2 with a trained BPE tokenizer, and
gateways in front of it, driven through aiohttp and the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from ember_core.kernels import cpu_ops
from tests.gateway.api.test_validation import assert_openai_error
from tests.gateway.conftest import parse_sse
from tests.gateway.tiny_tokenizer import write_model_with_tokenizer
from tests.processes import (
    STARTUP_TIMEOUT_S,
    engine_argv,
    free_port,
    gateway_argv,
    http_status,
    spawned,
    start_gateway,
    wait_until,
)

MODEL = "tiny"
API_KEY = "e2e-key"


def start_engine(model_dir: Path, address: str, log: Path):
    return spawned(engine_argv(model_dir, address, "--num-blocks", "64", "--served-model-name", MODEL), log)


@pytest.fixture(scope="module")
def model_dir(gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_with_tokenizer(gpt2_dir, tmp_path_factory.mktemp("e2e") / "gpt2-bpe")


class EngineProcess:
    """The module's engine worker; a test may kill it and start a new one on the same address."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.starts = 0
        self._stack = contextlib.ExitStack()
        self.process = self.start()

    def start(self) -> subprocess.Popen:
        self.starts += 1
        log = self.log_dir / f"engine-{self.starts}.log"
        self.process = self._stack.enter_context(start_engine(self.model_dir, self.address, log))
        return self.process

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    engine = EngineProcess(model_dir, tmp_path_factory.mktemp("engine-logs"))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def engine_address(engine: EngineProcess) -> str:
    return engine.address


@pytest.fixture(scope="module")
def url(engine_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # A short wait for a missing engine: a test here kills the engine and expects 503s.
    yield from start_gateway(engine_address, tmp_path_factory.mktemp("logs") / "gateway.log", "--engine-wait", "0.5")


@pytest.fixture(scope="module")
def limited_url(engine_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway that admits one engine request at a time and wants an API key."""
    log = tmp_path_factory.mktemp("logs") / "limited-gateway.log"
    yield from start_gateway(engine_address, log, "--max-pending", "1", "--api-key", API_KEY)


@pytest.fixture
def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


async def post_json(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def post_stream(session: aiohttp.ClientSession, url: str, body: Any) -> list[Any]:
    async with session.post(url, json=body) as response:
        assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
        assert response.headers["Cache-Control"] == "no-cache"
        return parse_sse(await response.text())


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith(f"{name}{{engine=") and f',model_name="{MODEL}"}} ' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def wait_for_metric(
    session: aiohttp.ClientSession, url: str, name: str, want: Callable[[float], bool], timeout: float = 10.0
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not want(await metric(session, url, name)):
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{name} never satisfied the condition")
        await asyncio.sleep(0.1)


# aiohttp client


async def test_health_models_and_metrics_routes(url: str, engine_address: str, engine: EngineProcess):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/health") as response:
            assert response.status == 200
        async with session.get(f"{url}/v1/models") as response:
            models = await response.json()
        assert [entry["id"] for entry in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == 256
        # a float checkpoint runs the exact numerics unless asked otherwise
        entry = models["data"][0]
        assert (entry["dtype"], entry["numerics"], entry["kv_cache_dtype"]) == ("float32", "exact", "float32")
        assert entry["cpu_build"] == cpu_ops.build_in_use()  # what its bits depend on, besides the request
        start_up = (engine.log_dir / f"engine-{engine.starts}.log").read_text()
        assert f"dtype float32, numerics exact, KV cache float32, CPU build {cpu_ops.build_in_use()}" in start_up
        async with session.get(f"{url}/metrics") as response:
            assert response.status == 200 and "ember_kv_cache_usage_perc" in await response.text()
        info = (
            f'ember_model_info{{cpu_build="{cpu_ops.build_in_use()}",dtype="float32",engine="{engine_address}",kv_cache_dtype="float32",'
            f'model_name="{MODEL}",numerics="exact"}} 1.0'
        )
        for _ in range(100):  # the engine's first stats (a few per second) bring its gauges
            async with session.get(f"{url}/metrics") as response:
                if info in await response.text():
                    break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{info} never in /metrics")


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_stream_equals_non_stream_at_temperature_0(url: str, route: str):
    if route == "completions":
        path, body, key = "/v1/completions", {"prompt": "Once upon a time"}, "text"
    else:
        path, body, key = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}]}, "content"
    body = {"model": MODEL, **body, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    async with aiohttp.ClientSession() as session:
        status, whole = await post_json(session, url + path, body)
        assert status == 200, whole
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        events = await post_stream(session, url + path, stream_body)
    assert events[-1] == "[DONE]"
    choice = whole["choices"][0]
    text = choice["text"] if key == "text" else choice["message"]["content"]
    streamed = "".join(
        c["text"] if key == "text" else c["delta"].get("content", "") for e in events[:-2] for c in e["choices"]
    )
    streamed_ids = [t for e in events[:-2] for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == text and streamed_ids == choice["token_ids"]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == len(choice["token_ids"]) <= 24


async def test_malformed_bodies_get_4xx_and_the_next_request_works(url: str):
    corpus = [
        (b"{oops", 400), (b"[]", 400), (json.dumps({"prompt": "x"}).encode(), 400),
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "temperature": 3}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": [384]}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 300}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "stop": [1]}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(), 400),
    ]
    async with aiohttp.ClientSession() as session:
        for body, expected in corpus:
            async with session.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}) as response:
                assert_openai_error(response.status, await response.json(), expected)
        async with session.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}) as response:
            assert_openai_error(response.status, await response.json(), 400)
        async with session.get(f"{url}/v1/nothing") as response:
            assert_openai_error(response.status, await response.json(), 404)
        good = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        status, body = await post_json(session, f"{url}/v1/completions", good)
        assert status == 200 and body["usage"]["completion_tokens"] == 2


async def test_client_disconnect_frees_the_kv_cache(url: str):
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{url}/v1/completions", json=body)
        for _ in range(3):
            await response.content.readuntil(b"\n\n")
        await wait_for_metric(session, url, "ember_num_requests_running", lambda value: value == 1)
        assert await metric(session, url, "ember_kv_cache_usage_perc") > 0
        response.close()
        await wait_for_metric(session, url, "ember_num_requests_running", lambda value: value == 0)
        await wait_for_metric(session, url, "ember_kv_cache_usage_perc", lambda value: value == 0)


async def test_overload_gets_429_and_a_key_is_required(limited_url: str):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    long_body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(headers=auth) as session, \
            session.post(f"{limited_url}/v1/completions", json=long_body) as in_flight:
        await in_flight.content.readuntil(b"\n\n")
        async with session.post(f"{limited_url}/v1/completions", json={"model": MODEL, "prompt": "x"}) as response:
            assert_openai_error(response.status, await response.json(), 429)
            assert int(response.headers["Retry-After"]) >= 1
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{limited_url}/v1/completions", json={"model": MODEL, "prompt": "x"}) as response:
            assert_openai_error(response.status, await response.json(), 401)
        async with session.get(f"{limited_url}/health") as response:
            assert response.status == 200
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the aborted stream leaves the gateway's count right away, the engine shortly after
            async with session.post(
                f"{limited_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, headers=auth
            ) as response:
                if response.status == 200:
                    break
                assert response.status == 429 and asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)


# the official openai client


def test_openai_completions(sdk: openai.OpenAI):
    greedy = sdk.completions.create(model=MODEL, prompt="The quick brown", max_tokens=16, temperature=0)
    text = greedy.choices[0].text
    assert greedy.object == "text_completion" and greedy.choices[0].finish_reason == "length"
    assert greedy.usage is not None and greedy.usage.completion_tokens == 16

    stop = text[4:6]
    stopped = sdk.completions.create(model=MODEL, prompt="The quick brown", max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    seeded = dict(model=MODEL, prompt=["The quick", "Hello"], max_tokens=12, temperature=1.0, n=2, seed=1234)
    first, again = sdk.completions.create(**seeded), sdk.completions.create(**seeded)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text

    with_logprobs = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    logprobs = with_logprobs.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert all(value <= 0 for value in logprobs.token_logprobs)


def test_openai_chat_and_streaming(sdk: openai.OpenAI):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi there"}]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    scored = sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, n=2, seed=5
    )
    assert len(scored.choices) == 2
    for choice in scored.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)

    streamed_completion = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in streamed_completion)
    assert text == sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0).choices[0].text


def test_openai_models_and_errors(sdk: openai.OpenAI, limited_url: str):
    assert [model.id for model in sdk.models.list()] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    wrong_key = openai.OpenAI(base_url=f"{limited_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    right_key = openai.OpenAI(base_url=f"{limited_url}/v1", api_key=API_KEY, max_retries=0)
    assert [model.id for model in right_key.models.list()] == [MODEL]


def test_gateway_does_not_import_torch():
    code = "import sys, ember_gateway.cli, ember_gateway.app; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


# process lifecycle


async def test_sigterm_lets_a_stream_finish_then_exits_0(engine_address: str, tmp_path: Path):
    port = free_port()
    log = tmp_path / "gateway.log"
    with spawned(gateway_argv(engine_address, port), log) as process:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_status(f"{url}/health") == 200, STARTUP_TIMEOUT_S, "a ready gateway")
        body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")
            process.send_signal(signal.SIGTERM)
            events = parse_sse("data: {}\n\n" + (await response.text()))
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=15) == 0


async def test_engine_death_fails_in_flight_requests_and_a_new_engine_is_picked_up(engine: EngineProcess, url: str):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")
            engine.process.kill()
            events = parse_sse("data: {}\n\n" + await asyncio.wait_for(response.text(), 10))
        assert events[-2]["error"]["type"] == "service_unavailable_error" and events[-1] == "[DONE]"
        async with session.get(f"{url}/health") as health:
            assert health.status == 503
        status, error = await post_json(session, f"{url}/v1/completions", {"model": MODEL, "prompt": "x"})
        assert_openai_error(status, error, 503)

        engine.start()
        await asyncio.to_thread(
            wait_until, lambda: http_status(f"{url}/health") == 200, STARTUP_TIMEOUT_S, "ready with the new engine"
        )
        short = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        status, _ = await post_json(session, f"{url}/v1/completions", short)
        assert status == 200
