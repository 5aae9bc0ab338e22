"""The product as users meet it: real engines and gateways as processes, the default model, `ember serve`."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
from pathlib import Path

import aiohttp
import openai
import pytest

from ember_core import LLM, SamplingParams
from tests.gateway.conftest import parse_sse
from tests.processes import (
    STARTUP_TIMEOUT_S,
    child_pids,
    engine_argv,
    free_port,
    http_status,
    spawned,
    start_gateway,
    stop_process,
    wait_until,
)

PROMPTS = [f"Request number {i}: the {word} of the day is" for i, word in enumerate(
    ["weather", "menu", "plan", "news", "word", "song", "idea", "price", "score", "quote", "joke", "fact"]
)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine_address(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    # A small pool and batch so the load also exercises queueing and preemption.
    argv = engine_argv(model_dir, address, "--num-blocks", "24", "--block-size", "4", "--max-num-seqs", "6",
                       "--served-model-name", "tiny")
    with spawned(argv, log):
        yield address


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str, stream: bool) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        if not stream:
            return (await response.json())["choices"][0]["text"]
        events = parse_sse(await response.text())
    assert events[-1] == "[DONE]"
    return "".join(event["choices"][0]["text"] for event in events[:-1] if event["choices"])


async def test_two_gateways_under_concurrent_load_return_every_result_correctly(
    engine_address: str, model_dir: Path, tmp_path: Path
) -> None:
    offline = LLM(str(model_dir), device="cpu", dtype="float32", num_blocks=256)
    expected = [o.text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))]
    first = start_gateway(engine_address, tmp_path / "gw1.log")
    second = start_gateway(engine_address, tmp_path / "gw2.log")
    urls = [next(first), next(second)]
    try:
        async with aiohttp.ClientSession() as session:
            jobs = [
                _complete(session, urls[i % 2], prompt, stream=bool(i % 3))
                for rounds in range(2)
                for i, prompt in enumerate(PROMPTS)
            ]
            results = await asyncio.wait_for(asyncio.gather(*jobs), 240)
            assert results == expected * 2
            for url in urls:
                async with session.get(f"{url}/metrics") as response:
                    text = await response.text()
                assert "ember_kv_cache_usage_perc" in text
    finally:
        for gateway in (first, second):
            gateway.close()


def test_gateway_serves_with_torch_unavailable(engine_address: str, tmp_path: Path) -> None:
    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is not available in this test')\n")
    gateway = start_gateway(engine_address, tmp_path / "gw.log", env={"PYTHONPATH": str(blocker.parent)})
    url = next(gateway)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert completion.choices[0].finish_reason in ("length", "stop")
        assert completion.usage.completion_tokens >= 1
    finally:
        gateway.close()


def test_ember_serve_runs_the_default_model_and_stops_cleanly(tmp_path: Path) -> None:
    """`ember serve` with no model argument: the real SmolLM2 GGUF behind a gateway, through the openai SDK."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["-m", "ember_cli", "serve", "--port", str(port), "--kv-cache-mib", "32", "--dtype", "float32"]
    # Without the system line the packaged Q4_1 file answers in French about l'Étoile, as llama.cpp does on it.
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "What is the capital of France?"}]
    with spawned(argv, tmp_path / "serve.log") as process:
        offline = LLM(device="cpu", dtype="float32", kv_cache_mib=32)
        prompt = offline.tokenizer.apply_chat_template(messages)
        expected = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
        wait_until(lambda: process.poll() is not None or http_status(f"{url}/health") == 200,
                   2 * STARTUP_TIMEOUT_S, "ember serve")
        assert process.poll() is None, (tmp_path / "serve.log").read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        models = client.models.list().data
        assert [m.id for m in models] == ["smollm2-135m-instruct"]
        assert (models[0].dtype, models[0].numerics) == ("float32", "fast")  # a quantized file: fast by default
        chat = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=messages, max_tokens=24, temperature=0
        )
        assert chat.choices[0].message.content == expected.text
        assert "Paris" in chat.choices[0].message.content
        assert chat.usage.prompt_tokens == len(prompt)
        # Scoring a text the way evaluation harnesses do: echo + logprobs returns the prompt's logprobs too.
        text = "The capital of France is Paris"
        text_ids = offline.tokenizer.encode_prompt(text)
        scored = offline.generate([text_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        echoed = client.completions.create(
            model="smollm2-135m-instruct", prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True
        ).choices[0]
        assert echoed.text.startswith(text)
        assert echoed.logprobs.token_logprobs[0] is None and len(echoed.logprobs.tokens) == len(text_ids) + 1
        assert echoed.logprobs.token_logprobs[1:-1] == pytest.approx([e.logprob for e in scored.prompt_logprobs], abs=1e-4)
        only_prompt = client.completions.create(
            model="smollm2-135m-instruct", prompt=text, max_tokens=0, logprobs=1, echo=True
        )
        assert only_prompt.choices[0].text == text and only_prompt.usage.completion_tokens == 0
        assert only_prompt.choices[0].logprobs.token_logprobs == echoed.logprobs.token_logprobs[:-1]
        # A priority under the default fcfs policy is refused, as vLLM refuses it.
        with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
            client.completions.create(model="smollm2-135m-instruct", prompt=text, max_tokens=1,
                                      extra_body={"priority": 2})
        process.send_signal(signal.SIGTERM)
        assert stop_process(process, timeout=30) == 0
    assert http_status(f"{url}/health") == 0  # nothing listens any more


def test_ember_serve_restarts_an_engine_killed_after_serving_even_while_it_reloads(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    argv = ["-m", "ember_cli", "serve", "--model", str(model_dir), "--port", str(port), "--dtype", "float32",
            "--num-blocks", "64", "--block-size", "4"]
    with spawned(argv, log) as process:
        wait_until(lambda: process.poll() is not None or "ember: ready" in log.read_text(), STARTUP_TIMEOUT_S, "serve")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        before = client.completions.create(model=str(model_dir), prompt="hello", max_tokens=4, temperature=0).choices[0].text
        killed = []
        for kill in range(2):  # the second kill lands while the restarted engine is still loading
            wait_until(lambda: bool(child_pids(process.pid, "ember_engine", exclude=killed)), 30, "an engine process")
            killed.append(child_pids(process.pid, "ember_engine", exclude=killed)[0])
            os.kill(killed[-1], signal.SIGKILL)
            restarts = kill + 1
            wait_until(lambda: log.read_text().count("the engine exited with signal SIGKILL; restarting it") == restarts,  # noqa: B023 - waited on at once
                       30, "restart log")
        wait_until(lambda: http_status(f"{url}/health") == 200, STARTUP_TIMEOUT_S, "the restarted engine")
        after = client.completions.create(model=str(model_dir), prompt="hello", max_tokens=4, temperature=0).choices[0].text
        assert after == before
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert stop_process(process, timeout=30) == 0


def test_with_engine_resume_wait_a_stream_whose_engine_is_killed_goes_on_with_the_same_tokens(
    model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    argv = ["-m", "ember_cli", "serve", "--model", str(model_dir), "--port", str(port), "--dtype", "float32",
            "--num-blocks", "64", "--block-size", "4", "--engine-resume-wait", "120"]
    with spawned(argv, log) as process:
        wait_until(lambda: process.poll() is not None or "ember: ready" in log.read_text(), STARTUP_TIMEOUT_S, "serve")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        request = {"model": str(model_dir), "prompt": "hello", "max_tokens": 200, "temperature": 1.0, "seed": 5,
                   "extra_body": {"ignore_eos": True}}
        expected = client.completions.create(**request).choices[0].text
        stream = client.completions.create(**request, stream=True)
        text = next(iter(stream)).choices[0].text
        engine = child_pids(process.pid, "ember_engine")[0]
        os.kill(engine, signal.SIGSTOP)  # mid-generation, before the rest of its 200 tokens
        os.kill(engine, signal.SIGKILL)
        chunks = list(stream)
        text += "".join(chunk.choices[0].text for chunk in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert text == expected
        assert "the engine exited with signal SIGKILL; restarting it" in log.read_text()
        assert re.search(r"resumed 1 requests in flight on engine", log.read_text())
        process.send_signal(signal.SIGTERM)
        assert stop_process(process, timeout=30) == 0


def test_ember_serve_stops_when_the_engine_cannot_start(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    argv = ["-m", "ember_cli", "serve", "--model", str(tmp_path / "no-such-model"), "--port", str(free_port())]
    with spawned(argv, log) as process:
        wait_until(lambda: process.poll() is not None, STARTUP_TIMEOUT_S, "serve to give up")
        assert process.returncode == 1
    assert re.search(r"the engine exited with code \d+ before the server became healthy; stopping", log.read_text())


def test_ember_serve_on_port_0_names_its_port_and_keeps_it_when_the_gateway_restarts(model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    argv = ["-m", "ember_cli", "serve", "--model", str(model_dir), "--port", "0", "--dtype", "float32",
            "--num-blocks", "64", "--block-size", "4"]
    with spawned(argv, log) as process:
        wait_until(lambda: process.poll() is not None or "ember: ready" in log.read_text(), STARTUP_TIMEOUT_S, "serve")
        port = int(re.search(r"serving .* on http://127\.0\.0\.1:(\d+)/v1", log.read_text())[1])
        assert port != 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        before = client.completions.create(model=str(model_dir), prompt="hello", max_tokens=4, temperature=0).choices[0].text
        os.kill(child_pids(process.pid, "ember_gateway")[0], signal.SIGKILL)
        # Sent at once on a new connection (the client's kept-alive one died with the gateway):
        # `ember serve` keeps the socket open, so it waits in the backlog, then the request waits
        # in the new gateway until its engine answers.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        after = client.completions.create(model=str(model_dir), prompt="hello", max_tokens=4, temperature=0).choices[0].text
        assert after == before
        assert "the gateway exited with signal SIGKILL; restarting it" in log.read_text()
        process.send_signal(signal.SIGTERM)
        assert stop_process(process, timeout=30) == 0


def test_ember_serve_on_a_taken_port_stops_at_once_without_saying_ready(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with spawned(["-m", "ember_cli", "serve", "--port", str(port)], log) as process:
            wait_until(lambda: process.poll() is not None, 30, "serve to give up")
            assert process.returncode == 1
    text = log.read_text()
    assert text.strip() == f"ember: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    with spawned(["-m", "ember_cli", "serve", "--host", "256.1.1.1"], log) as process:
        wait_until(lambda: process.poll() is not None, 30, "serve to give up")
        assert process.returncode == 1
    assert re.fullmatch(r"ember: error: cannot listen on 256\.1\.1\.1:8000: [A-Z][a-z ]+", log.read_text().strip())
