"""A gateway in front of several (fake) engines: routing, discovery by DNS, and requests that move
to another engine when theirs is killed or drains."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ember_core.cache.block_hash import prompt_block_hashes
from ember_gateway.app import create_app, start_runner
from ember_gateway.config import GatewayConfig
from ember_gateway.engines import pool as engine_pool
from ember_gateway.engines.kv_index import KvIndex
from ember_gateway.engines.pool import EnginePool
from ember_gateway.engines.router import Candidate, Decision, choose
from ember_proto import KvEvents
from tests.gateway.conftest import parse_sse, wait_until_async
from tests.gateway.fake_engine import FakeEngine
from tests.processes import free_port

PROMPT = "a shared system prompt, then the question"


class Front:
    """A gateway app over a pool, and an HTTP session to it."""

    def __init__(self, pool: EnginePool, http: aiohttp.ClientSession) -> None:
        self.pool = pool
        self.http = http

    async def complete(self, prompt: str = PROMPT, **fields: Any) -> tuple[int, Any]:
        body = {"model": "fake-model", "prompt": prompt, "max_tokens": 3, **fields}
        async with self.http.post("/v1/completions", json=body) as response:
            return response.status, await response.json()

    async def stream(self, **fields: Any) -> list[Any]:
        body = {"model": "fake-model", "prompt": PROMPT, "stream": True, **fields}
        async with self.http.post("/v1/completions", json=body) as response:
            assert response.status == 200
            return parse_sse(await response.text())

    async def metrics(self) -> str:
        async with self.http.get("/metrics") as response:
            return await response.text()


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    fakes = [FakeEngine(f"tcp://127.0.0.1:{free_port()}") for _ in range(2)]
    for fake in fakes:
        await fake.start()
    yield fakes
    for fake in fakes:
        await fake.stop()


@pytest.fixture
async def start_front() -> AsyncIterator[Any]:
    cleanups: list[Any] = []

    async def start(
        addresses: list[str], routing: str = "round-robin", wait_for: int | None = None, max_pending: int = 256,
        **pool_args: Any,
    ) -> Front:
        config = GatewayConfig(
            engine_addresses=tuple(addresses), routing=routing, port=free_port(), engine_timeout=3.0,
            max_pending=max_pending,
        )
        pool = EnginePool(addresses, routing=routing, watchdog_s=3.0, **pool_args)
        runner = await start_runner(create_app(config, pool), shutdown_timeout=1.0)
        await web.TCPSite(runner, "127.0.0.1", config.port).start()
        http = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{config.port}")
        cleanups.extend([http.close, runner.cleanup])
        count = len(addresses) if wait_for is None else wait_for
        await wait_until_async(lambda: sum(c.accepting for c in pool.clients.values()) >= count, 5.0, "engines ready")
        return Front(pool, http)

    yield start
    for cleanup in cleanups:
        await cleanup()


async def test_requests_spread_over_the_engines_and_the_model_is_listed_once(engines, start_front):
    front = await start_front([engine.address for engine in engines])
    for _ in range(4):
        status, body = await front.complete()
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert [len(engine.received) for engine in engines] == [2, 2]
    async with front.http.get("/v1/models") as response:
        assert [model["id"] for model in (await response.json())["data"]] == ["fake-model"]
    async with front.http.get("/health") as response:
        health = await response.json()
    assert response.status == 200 and sorted(health["engines"]) == sorted(e.address for e in engines)
    assert 'ember_routing_decisions_total{reason="round_robin"} 4.0' in await front.metrics()


async def test_kv_routing_sends_a_prompt_to_the_engine_holding_its_prefix(engines, start_front):
    holder, other = engines
    prompt_ids = list(PROMPT.encode())  # the fake engines' byte tokenizer
    for engine in engines:
        engine.block_size = 4
    holder.cached_hashes = prompt_block_hashes(prompt_ids, 4)
    front = await start_front([other.address, holder.address], routing="kv")
    await wait_until_async(lambda: len(front.pool.clients[holder.address].kv_index) > 0, 5.0, "the snapshot")
    for _ in range(3):
        assert (await front.complete())[0] == 200
    assert (len(holder.received), len(other.received)) == (3, 0)
    await front.complete(prompt="something else entirely")  # no engine holds it: the other one, idler
    assert 'ember_routing_decisions_total{reason="prefix"} 3.0' in await front.metrics()


TENANT = "The notes of one tenant, shared by all its users. " * 24  # 1,200 bytes: 300 blocks of 4


async def start_tenant_front(engines: list[FakeEngine], start_front: Any) -> Front:
    """A kv-routing gateway over engines (the first holding TENANT's blocks), once both reported."""
    for engine in engines:
        engine.block_size, engine.max_model_len = 4, 2048
    engines[0].cached_hashes = prompt_block_hashes(list(TENANT.encode()), 4)
    front = await start_front([engine.address for engine in reversed(engines)], routing="kv")
    clients = [front.pool.clients[engine.address] for engine in engines]
    reported = [(e.backlog_running + e.backlog_waiting, e.backlog_prefill_tokens) for e in engines]

    def caught_up() -> bool:
        stats = [client.stats for client in clients]
        return len(clients[0].kv_index) > 0 and [
            (s.num_running + s.num_waiting, s.num_queued_prefill_tokens) if s else None for s in stats
        ] == reported

    await wait_until_async(caught_up, 5.0, "the engines' snapshot and stats")
    return front


async def test_a_tenant_stays_on_its_engine_while_the_other_is_less_loaded_but_not_idle(engines, start_front):
    holder, other = engines
    holder.backlog_running, holder.backlog_waiting, holder.backlog_prefill_tokens = 16, 10, 300
    other.backlog_running, other.backlog_waiting, other.backlog_prefill_tokens = 2, 1, 40
    front = await start_tenant_front(engines, start_front)
    for user in range(4):
        assert (await front.complete(prompt=f"{TENANT}User {user}: hello?"))[0] == 200
    assert (len(holder.received), len(other.received)) == (4, 0)
    assert 'ember_routing_decisions_total{reason="prefix"} 4.0' in await front.metrics()


@pytest.mark.parametrize("leaves", ["drains", "is lost"])
async def test_a_tenant_moves_when_its_engine_drains_or_is_lost(engines, start_front, leaves):
    holder, other = engines
    front = await start_tenant_front(engines, start_front)
    assert (await front.complete(prompt=f"{TENANT}User 0: hello?"))[0] == 200
    if leaves == "drains":
        holder.drain()
    else:
        await holder.stop()
    await wait_until_async(lambda: not front.pool.clients[holder.address].accepting, 5.0, "the holder leaving")
    assert (await front.complete(prompt=f"{TENANT}User 1: hello?"))[0] == 200
    assert (len(holder.received), len(other.received)) == (1, 1)


async def test_an_idle_engine_takes_new_tenants_and_what_a_busy_holder_cannot_start(engines, start_front):
    holder, other = engines
    holder.backlog_running, holder.backlog_waiting, holder.backlog_prefill_tokens = 8, 4, 800
    front = await start_tenant_front(engines, start_front)
    assert (await front.complete(prompt=f"{TENANT}User 0: hello?"))[0] == 200  # cheaper at the holder, yet
    assert (await front.complete(prompt="A new tenant's first words."))[0] == 200
    assert (len(holder.received), len(other.received)) == (0, 2)
    metrics = await front.metrics()
    assert 'reason="idle"} 1.0' in metrics and 'reason="load"} 1.0' in metrics


async def test_when_every_engine_is_behind_the_gateway_answers_429_with_retry_after(engines, start_front):
    for engine in engines:
        engine.step_interval = 0.5  # slow steps: whatever is sent stays in flight
    front = await start_front([engine.address for engine in engines], routing="kv", max_pending=4)
    held = [asyncio.create_task(front.complete(prompt=f"user {user}", max_tokens=4)) for user in range(4)]
    await wait_until_async(lambda: sum(engine.num_running for engine in engines) == 4, 5.0, "four requests running")
    assert front.pool.num_in_flight == 4 and all(engine.num_running for engine in engines)  # on both engines
    body = {"model": "fake-model", "prompt": "one more", "max_tokens": 2}
    async with front.http.post("/v1/completions", json=body) as response:
        assert response.status == 429 and response.headers["Retry-After"] == "1"
        assert (await response.json())["error"]["type"]
    assert [status for status, _ in await asyncio.gather(*held)] == [200] * 4
    assert (await front.complete(prompt="one more", max_tokens=2))[0] == 200  # and takes work again


async def test_a_killed_engine_s_stream_goes_on_from_another_without_an_error(engines, start_front):
    first, second = engines
    for engine in engines:
        engine.step_interval = 0.05
    front = await start_front([first.address, second.address])
    stream = asyncio.create_task(front.stream(max_tokens=20))
    await wait_until_async(lambda: first.num_running == 1 and _produced(first) >= 4, 5.0, "tokens from the first engine")
    await first.stop()
    events = await stream
    text = "".join(event["choices"][0]["text"] for event in events[:-1] if event["choices"])
    assert not [event for event in events if isinstance(event, dict) and "error" in event]
    assert text == first.tokenizer.decode(first.reply_ids[:20])  # every token once, in order
    resumed = second.received[-1]
    assert 4 <= len(resumed.output_token_ids) < 20 and resumed.request_id == first.received[-1].request_id
    assert "ember_request_migrations_total 1.0" in await front.metrics()


async def test_requests_never_move_between_engines_of_different_settings(engines, start_front, caplog):
    """Two engines of one model, one in float32 and one in bfloat16: both serve, the gateway warns,
    and a stream on the killed one fails rather than go on in other arithmetic."""
    first, second = engines
    second.dtype = "float32"  # its card says so from its first Ready on
    first.step_interval = 0.05
    with caplog.at_level("WARNING", logger="ember_gateway.engines.pool"):
        front = await start_front([first.address, second.address])
    (warning,) = [record.getMessage() for record in caplog.records if "different settings" in record.getMessage()]
    assert "serve fake-model with different settings (dtype " in warning and "bfloat16" in warning
    stream = asyncio.create_task(front.stream(max_tokens=20))
    await wait_until_async(lambda: first.num_running == 1 and _produced(first) >= 2, 5.0, "tokens from the first engine")
    await first.stop()
    events = await stream
    assert [event for event in events if isinstance(event, dict) and "error" in event]
    assert not [generate for generate in second.received if generate.output_token_ids]  # nothing continued there
    assert "ember_request_migrations_total 0.0" in await front.metrics()


async def test_a_hung_engine_s_stream_goes_on_from_another_after_the_engine_timeout(engines, start_front):
    first, second = engines
    first.step_interval = 0.05
    front = await start_front([first.address, second.address])  # an engine timeout of 3 s
    stream = asyncio.create_task(front.stream(max_tokens=20))
    await wait_until_async(lambda: first.num_running == 1 and _produced(first) >= 2, 5.0, "tokens from the first engine")
    first.paused = True  # neither steps nor heartbeats: hung
    events = await asyncio.wait_for(stream, 10.0)
    assert not [event for event in events if isinstance(event, dict) and "error" in event]
    text = "".join(event["choices"][0]["text"] for event in events[:-1] if event["choices"])
    assert text == first.tokenizer.decode(first.reply_ids[:20])
    assert second.received[-1].output_token_ids and not front.pool.clients[first.address].accepting


async def test_a_draining_engine_gets_no_new_requests_and_hands_over_its_own(engines, start_front):
    first, second = engines
    first.step_interval = 0.05
    front = await start_front([first.address, second.address])
    stream = asyncio.create_task(front.stream(max_tokens=20))
    await wait_until_async(lambda: first.num_running == 1 and _produced(first) >= 2, 5.0, "tokens from the first engine")
    first.drain()
    events = await stream
    assert not [event for event in events if isinstance(event, dict) and "error" in event]
    assert second.received[-1].output_token_ids  # it went on from where it was
    for _ in range(3):
        assert (await front.complete())[0] == 200
    assert len(first.received) == 1 and first.aborted == [first.received[0].request_id]


async def test_a_dns_name_s_engines_are_followed_as_they_come_and_go(start_front, monkeypatch):
    monkeypatch.setattr(engine_pool, "DNS_INTERVAL_S", 0.1)
    port = free_port()
    fakes = [FakeEngine(f"tcp://127.0.0.{host}:{port}") for host in (1, 2)]
    for fake in fakes:
        await fake.start()
    answers = {"now": ["127.0.0.1"]}

    async def resolve(name: str, resolve_port: int) -> list[str]:
        assert (name, resolve_port) == ("engines.internal", port)
        return answers["now"]

    try:
        front = await start_front([f"dns+tcp://engines.internal:{port}"], resolve=resolve)
        answers["now"] = ["127.0.0.1", "127.0.0.2"]
        await wait_until_async(lambda: sum(c.accepting for c in front.pool.clients.values()) == 2, 5.0, "the new engine")
        answers["now"] = ["127.0.0.2"]
        await wait_until_async(lambda: list(front.pool.clients) == [fakes[1].address], 5.0, "the old engine gone")
        assert (await front.complete())[0] == 200
        assert len(fakes[1].received) == 1
    finally:
        for fake in fakes:
            await fake.stop()


def _produced(engine: FakeEngine) -> int:
    return max((running.produced for running in engine._running.values()), default=0)


def test_kv_index_applies_batches_in_order_and_asks_for_a_snapshot_after_a_gap() -> None:
    index = KvIndex()
    assert not index.apply(KvEvents("e", 2, [b"a", b"b"], snapshot=True))
    assert not index.apply(KvEvents("e", 3, [b"c"], [b"a"]))
    assert index.cached_prefix([b"b", b"c", b"d"], ()) == 2 and index.cached_prefix([b"a", b"b"], ()) == 0
    assert index.apply(KvEvents("e", 5, [b"x"]))  # 4 went missing: ask once
    assert not index.apply(KvEvents("e", 6, [b"y"]))  # and wait for the snapshot
    assert len(index) == 2
    assert not index.apply(KvEvents("e", 6, [b"x", b"y"], snapshot=True))
    assert not index.apply(KvEvents("e", 7, [b"z"]))
    assert index.cached_prefix([b"x", b"y", b"z"], ()) == 3


def test_a_routed_prompt_s_blocks_count_while_its_request_is_in_flight() -> None:
    index = KvIndex()
    index.apply(KvEvents("e", 0, [b"a"], snapshot=True))
    index.expect("r1", [b"a", b"b", b"c"], {"r1"})
    assert index.cached_prefix([b"a", b"b", b"c", b"d"], {"r1"}) == 3  # however long r1 queues
    index.apply(KvEvents("e", 1, [b"b"]))  # the engine computed its first block
    assert index.cached_prefix([b"a", b"b", b"c"], set()) == 2  # r1 ended: only what was reported


def test_the_router_weighs_a_cached_prefix_against_a_longer_queue_in_tokens() -> None:
    def engine(queued: int, uncached: int, waiting: int = 0, running: int = 0) -> Candidate:
        return Candidate(queued, waiting, running, uncached, step_token_budget=512, idle=queued == running == 0)

    holder = engine(queued=900, uncached=100, waiting=3, running=16)  # (900 + 100 x 4) x 512/496 = 1,342
    assert choose([engine(300, 1100, running=8), holder], "kv", turn=0) == Decision(1, "prefix")  # 1,422
    busier = engine(queued=1500, uncached=100, waiting=3, running=16)  # 1,961
    assert choose([engine(300, 1100, running=8), busier], "kv", turn=0) == Decision(0, "load")
    # where requests queue, the work a request causes delays those behind it too: the tenant stays
    assert choose([engine(300, 1100, waiting=2, running=8), busier], "kv", turn=0) == Decision(1, "prefix")
    assert choose([engine(300, 1100, running=8), holder], "load", turn=0) == Decision(0, "load")  # no cache
    assert engine(queued=0, uncached=512, running=256).cost == 1024  # half of every step decodes
    # starvation, not imbalance: an idle engine takes what the holder cannot start in its next step
    assert choose([engine(0, 1100), engine(600, 100, 2, running=4)], "kv", turn=0) == Decision(0, "idle")
    assert choose([engine(0, 1100), engine(400, 100, 2, running=4)], "kv", turn=0) == Decision(1, "prefix")
    other = engine(300, 1100)
    assert [choose([other, other], "round-robin", turn=t).index for t in range(4)] == [0, 1, 0, 1]
    assert [choose([other, other], "kv", turn=t).index for t in range(4)] == [0, 1, 0, 1]  # ties rotate
