"""Several engines behind several gateways, as real processes on loopback: every request served
with one engine's greedy output, an engine SIGKILLed under load without a client error, a
conversation's turns kept on the engine that holds its prefix, and an engine that joins late."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.gateway.conftest import parse_sse
from tests.processes import (
    STARTUP_TIMEOUT_S,
    engine_argv,
    free_port,
    http_status,
    spawned,
    start_gateway,
    wait_until,
)

WORDS = ["river", "forest", "castle", "market", "engine", "garden", "harbor", "library", "bridge", "valley"]
PROMPTS = [f"Question {i}: what do you know about the {word}?" for i, word in enumerate(WORDS)]
MAX_TOKENS = 8
ENGINE_FLAGS = ("--num-blocks", "96", "--block-size", "4", "--max-num-seqs", "8", "--served-model-name", "tiny")


def start_engine(stack: ExitStack, model_dir: Path, log: Path, *extra: str) -> tuple[str, subprocess.Popen]:
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = engine_argv(model_dir, address, *ENGINE_FLAGS, *extra)
    process = stack.enter_context(spawned(argv, log, {"OMP_NUM_THREADS": "1"}))
    return address, process


def gateway(stack: ExitStack, engines: list[str], log: Path, *extra: str) -> str:
    generator: Iterator[str] = start_gateway(",".join(engines), log, "--engine-wait", "30", *extra)
    stack.callback(generator.close)
    return next(generator)


def body(kind: str, prompt: str, stream: bool, n: int) -> dict[str, Any]:
    common = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream, "n": n}
    if kind == "chat":
        return {**common, "messages": [{"role": "user", "content": prompt}]}
    return {**common, "prompt": prompt}


async def texts(session: aiohttp.ClientSession, url: str, kind: str, request: dict[str, Any]) -> list[str]:
    """Each choice's text; fails on anything but a clean 200 (an error event included)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with session.post(f"{url}{path}", json=request) as response:
        assert response.status == 200, await response.text()
        if not request["stream"]:
            choices = (await response.json())["choices"]
            return [c["message"]["content"] if kind == "chat" else c["text"] for c in choices]
        events = parse_sse(await response.text())
    assert events[-1] == "[DONE]" and not any("error" in event for event in events[:-1]), events
    parts = [""] * request["n"]
    for event in events[:-1]:
        for choice in event["choices"]:
            text = (choice["delta"].get("content") or "") if kind == "chat" else choice["text"]
            parts[choice["index"]] += text
    return parts


async def metric_sum(session: aiohttp.ClientSession, urls: list[str], name: str, engine: str | None = None) -> float:
    """A series summed over gateways (per-engine series: the first gateway's, for one engine)."""
    total = 0.0
    for url in urls if engine is None else urls[:1]:
        async with session.get(f"{url}/metrics") as response:
            for line in (await response.text()).splitlines():
                match = re.match(rf'{name}(?:{{(.*)}})? (\S+)$', line)
                if match and (engine is None or f'engine="{engine}"' in (match[1] or "")):
                    total += float(match[2])
    return total


async def test_three_gateways_two_engines_a_killed_engine_and_no_request_lost(model_dir: Path, tmp_path: Path):
    kinds = list(itertools.product(["completion", "chat"], PROMPTS))
    with ExitStack() as stack:
        (first, first_process), (second, _) = (start_engine(stack, model_dir, tmp_path / f"engine{i}.log") for i in (1, 2))
        alone = gateway(stack, [first], tmp_path / "alone.log")
        urls = [gateway(stack, [first, second], tmp_path / f"gw{i}.log") for i in range(3)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            # one engine's greedy answers, asked one at a time
            expected = {key: (await texts(session, alone, key[0], body(*key, False, 1)))[0] for key in kinds}
            requests = [(kinds[i % len(kinds)], bool(i % 2), 1 + (i % 3 == 0)) for i in range(200)]
            done = 0
            limit = asyncio.Semaphore(16)

            async def one(index: int) -> list[str]:
                nonlocal done
                (kind, prompt), stream, n = requests[index]
                async with limit:
                    result = await texts(session, urls[index % 3], kind, body(kind, prompt, stream, n))
                done += 1
                return result

            tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
            while done < 60:
                await asyncio.sleep(0.01)
            first_process.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            for ((kind, prompt), _, n), got in zip(requests, results):
                assert got == [expected[kind, prompt]] * n, (kind, prompt)
            assert await metric_sum(session, urls, "ember_request_migrations_total") >= 1


async def test_a_conversation_stays_on_the_engine_holding_its_prefix_and_a_late_engine_takes_work(
    model_dir: Path, tmp_path: Path
):
    with ExitStack() as stack:
        first, _ = start_engine(stack, model_dir, tmp_path / "engine1.log")
        second = f"tcp://127.0.0.1:{free_port()}"  # not up yet
        url = gateway(stack, [first, second], tmp_path / "gw.log")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            messages = [{"role": "system", "content": "Answer in one short sentence."}]
            turn_hits = []
            for turn in range(4):
                messages.append({"role": "user", "content": f"And place {turn}?"})
                request = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
                answer = (await texts(session, url, "chat", {**request, "stream": False, "n": 1}))[0]
                messages.append({"role": "assistant", "content": answer})
                turn_hits.append(await metric_sum(session, [url], "ember_prefix_cache_hits_total", first))
                if turn == 0:  # the second engine comes up between the first turns
                    stack.enter_context(spawned(engine_argv(model_dir, second, *ENGINE_FLAGS), tmp_path / "engine2.log",
                                                {"OMP_NUM_THREADS": "1"}))
                    await _wait_for_engines(session, url, 2, sorted(tmp_path.glob("*.log")))
            # every later turn found the earlier ones cached on the engine that served them
            assert all(later > earlier for earlier, later in itertools.pairwise(turn_hits)), turn_hits
            for word in WORDS:  # prompts that share no block: the newcomer takes its share
                await texts(session, url, "completion", body("completion", f"{word}, and more", False, 1))
            assert await metric_sum(session, [url], "ember_prefix_cache_queries_total", second) > 0


async def test_engines_of_two_cache_dtypes_behind_one_gateway_each_keep_their_prefixes(model_dir: Path, tmp_path: Path):
    """An int8 cache's blocks hash apart from a float32 cache's (the same tokens are other bits):
    the gateway hashes a prompt per engine's cache dtype, so each conversation's later turns go to
    the engine holding its earlier ones, whichever cache that engine keeps."""
    with ExitStack() as stack:
        engines = [
            start_engine(stack, model_dir, tmp_path / f"engine_{dtype}.log", "--kv-cache-dtype", dtype)[0]
            for dtype in ("float32", "int8")
        ]
        url = gateway(stack, engines, tmp_path / "gw.log")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await _wait_for_engines(session, url, 2, sorted(tmp_path.glob("*.log")))
            # Completions, so no chat template puts a shared first block in front of every prompt.
            conversations = [f"{word}: tell me what you know about it." for word in WORDS[:4]]
            for turn in range(3):
                for i, prompt in enumerate(conversations):
                    answer = (await texts(session, url, "completion", body("completion", prompt, False, 1)))[0]
                    conversations[i] = f"{prompt}{answer} And then, turn {turn}?"
            # Every later turn was routed for its cached prefix: 4 conversations x 2 turns.
            assert await metric_sum(session, [url], "ember_routing_decisions_total") == 12
            assert await _routing_decisions(session, url, "prefix") == 8
            for engine in engines:  # both caches served conversations and found their prefixes
                await _wait_for_metric(session, url, "ember_prefix_cache_hits_total", engine)


async def _routing_decisions(session: aiohttp.ClientSession, url: str, reason: str) -> float:
    async with session.get(f"{url}/metrics") as response:
        match = re.search(rf'ember_routing_decisions_total{{reason="{reason}"}} (\S+)', await response.text())
    assert match, f"no ember_routing_decisions_total for reason {reason}"
    return float(match[1])


async def _wait_for_metric(session: aiohttp.ClientSession, url: str, name: str, engine: str) -> None:
    """Engines report their counters to the gateway every so often: wait for one to be positive."""
    for _ in range(100):
        if await metric_sum(session, [url], name, engine) > 0:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"{name} of {engine} stayed at 0")


async def _wait_for_engines(session: aiohttp.ClientSession, url: str, count: int, logs: list[Path]) -> None:
    """Until the gateway's /health lists count engines; a failure shows the processes' logs."""
    deadline = time.monotonic() + 2 * STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        async with session.get(f"{url}/health") as response:
            if response.status == 200 and len((await response.json())["engines"]) == count:
                return
        await asyncio.sleep(0.1)
    tails = "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]) for log in logs)
    pytest.fail(f"the gateway never saw {count} engines\n{tails}")


def test_ember_serve_splits_the_cores_between_its_engines(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    argv = ["-m", "ember_cli", "serve", "--model", str(model_dir), "--port", str(port), "--dtype", "float32",
            "--num-blocks", "64", "--block-size", "4", "--data-parallel-size", "2"]
    with spawned(argv, log):
        url = f"http://127.0.0.1:{port}"

        def engines() -> int:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    return len(json.load(response)["engines"])
            except OSError:
                return 0

        wait_until(lambda: engines() == 2, STARTUP_TIMEOUT_S, "two engines behind the gateway")
        for prompt in PROMPTS[:4]:
            request = urllib.request.Request(
                f"{url}/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": str(model_dir), "prompt": prompt, "max_tokens": 2}).encode(),
            )
            assert http_status(request, timeout=30) == 200
    shares = re.findall(r"engine (\d): (\d+) threads? on cores \[([\d, ]+)\]", log.read_text())
    assert [index for index, _, _ in shares] == ["0", "1"]
    cores = [set(map(int, listed.split(", "))) for _, _, listed in shares]
    assert all(int(count) == len(share) for (_, count, _), share in zip(shares, cores))
    assert not cores[0] & cores[1] or len(os.sched_getaffinity(0)) < 2
