"""GET /dashboard, its files and its feed: the page behind the API key (a header or ?key=), and the
feed's updates from a real engine, whose blocks a request holds and then frees."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest

from ember_proto import BLOCK_HELD
from tests.conftest import write_gpt2_checkpoint
from tests.gateway.api.test_openapi import ember_errors
from tests.gateway.conftest import Gateway, StartGateway, wait_until_async
from tests.gateway.fake_engine import FakeEngine
from tests.processes import engine_argv, free_port, spawned

NUM_BLOCKS = 512
MAX_TOKENS = 900  # about a second or more of decoding, so that block maps (4 a second) see it run


async def test_the_page_and_its_files_are_served(gateway: Gateway):
    async with gateway.http.get("/dashboard") as response:
        assert response.status == 200 and response.content_type == "text/html"
        page = await response.text()
    for name, media_type in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        assert f'"dashboard/{name}"' in page
        async with gateway.http.get(f"/dashboard/{name}") as response:
            assert response.status == 200 and response.content_type == media_type and await response.text()


async def test_with_an_api_key_the_page_and_feed_take_it_as_a_header_or_query(fake_engine: FakeEngine,
                                                                               start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, api_key="secret")
    expected = {
        "/dashboard": 401, "/dashboard?key=wrong": 401, "/dashboard?key=secret": 200,
        "/dashboard/dashboard.js": 200, "/v1/models?key=secret": 401,  # ?key= is the dashboard's only
    }
    for path, status in expected.items():
        async with gateway.http.get(path) as response:
            assert response.status == status, path
    async with gateway.http.get("/dashboard") as response:
        assert "open /dashboard?key=KEY" in (await response.json())["error"]["message"]
    async with gateway.http.get("/dashboard", headers={"Authorization": "Bearer secret"}) as response:
        assert response.status == 200
    async with gateway.http.get("/dashboard/events?key=secret") as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        assert ember_errors(await _next_update(response), "DashboardUpdate") == []


async def _next_update(response: aiohttp.ClientResponse) -> dict[str, Any]:
    while True:
        line = (await response.content.readline()).decode()
        if line.startswith("data: "):
            return json.loads(line[len("data: "):])


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    model_dir = write_gpt2_checkpoint(tmp_path_factory.mktemp("gpt2"), n_embd=256, n_layer=4, n_positions=1024)
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = engine_argv(model_dir, address, "--num-blocks", str(NUM_BLOCKS), "--block-size", "4")
    with spawned(argv, tmp_path_factory.mktemp("engine") / "engine.log"):
        yield SimpleNamespace(address=address)


def _held(engine: dict[str, Any]) -> int:
    return int((np.frombuffer(base64.b64decode(engine["holders"]), dtype="<u2") >= BLOCK_HELD).sum())


async def _until(response: aiohttp.ClientResponse, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    update: dict[str, Any] = {}
    try:
        async with asyncio.timeout(120):
            while not condition(update := await _next_update(response)):
                assert ember_errors(update, "DashboardUpdate") == []
    except TimeoutError:
        raise AssertionError(f"no update met the condition; the last: {json.dumps(update)[:2000]}") from None
    return update


async def test_the_feed_shows_a_request_holding_blocks_then_freeing_them(real_engine: SimpleNamespace,
                                                                         start_gateway: StartGateway):
    gateway = await start_gateway(real_engine, watchdog_s=30.0, wait_ready=False)
    await wait_until_async(lambda: gateway.client.ready, 120, "the engine to start")
    prompt = list(range(1, 41))  # 10 blocks of 4
    async with gateway.http.get("/dashboard/events") as feed:
        idle = await _until(feed, lambda u: u["engines"] and u["engines"][0]["holders"])
        (engine,) = idle["engines"]
        assert (engine["address"], engine["num_blocks"], _held(engine)) == (real_engine.address, NUM_BLOCKS, 0)
        body = {"model": engine["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        completion = asyncio.create_task(gateway.post("/v1/completions", body))
        busy = await _until(feed, lambda u: u["engines"][0]["running"])
        assert _held(busy["engines"][0]) >= len(prompt) // 4 and len(busy["engines"][0]["running"]) == 1
        status, answer = await completion
        assert status == 200, answer
        done = await _until(feed, lambda u: not u["engines"][0]["running"] and _held(u["engines"][0]) == 0)
        assert all(step["decode_tokens"] == step["batch_size"] == 1 for step in done["engines"][0]["steps"][-60:])
        # A new prompt of 40 tokens and one token out: one step, of 39 prefill tokens and the last one
        fresh = {**body, "prompt": list(range(100, 140)), "max_tokens": 1}
        assert (await gateway.post("/v1/completions", fresh))[0] == 200
        await _until(feed, lambda u: u["engines"][0]["steps"][-1] == {
            "prefill_tokens": 39, "decode_tokens": 1, "batch_size": 1, "seconds": u["engines"][0]["steps"][-1]["seconds"]})
    totals = done["totals"]
    assert totals["generation_tokens"] - idle["totals"]["generation_tokens"] == MAX_TOKENS
    assert totals["time_to_first_token_count"] == 1 and totals["inter_token_latency_count"] > 0
