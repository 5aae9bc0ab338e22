"""Gateways in the test's event loop, talking to a FakeEngine over real zmq sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ember_gateway.app import create_app, start_runner
from ember_gateway.config import GatewayConfig
from ember_gateway.engines.client import EngineClient
from ember_gateway.engines.pool import EnginePool
from ember_gateway.state import STATE
from tests.gateway.fake_engine import CHATML, FakeEngine, byte_tokenizer_spec
from tests.processes import free_port


async def wait_until_async(condition: Callable[[], bool], timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Gateway:
    url: str
    http: aiohttp.ClientSession
    pool: EnginePool

    @property
    def client(self) -> EngineClient:
        """The connection to the one engine these tests run."""
        return next(iter(self.pool.clients.values()))

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
        async with self.http.post(path, json=body, **kwargs) as response:
            return response.status, await response.json()

    async def stream(self, path: str, body: Any, **kwargs: Any) -> list[Any]:
        """The decoded `data:` payloads of an SSE response, [DONE] as the string "[DONE]"."""
        async with self.http.post(path, json=body, **kwargs) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"] == "text/event-stream"
            return parse_sse(await response.text())


def parse_sse(text: str) -> list[Any]:
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


StartGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(f"tcp://127.0.0.1:{free_port()}")
    await engine.start()
    yield engine
    await engine.stop()


ReplyingEngine = Callable[..., Awaitable[FakeEngine]]


@pytest.fixture
async def replying() -> AsyncIterator[ReplyingEngine]:
    """replying(text, chat_template=CHATML, control_tokens=()) -> a started fake engine whose every
    answer is text (control tokens written in it are those tokens)."""
    engines: list[FakeEngine] = []

    async def start(reply: str, chat_template: str = CHATML, control_tokens: tuple[str, ...] = ()) -> FakeEngine:
        engine = FakeEngine(f"tcp://127.0.0.1:{free_port()}", reply_text=reply, max_model_len=4096,
                            tokenizer_spec=byte_tokenizer_spec(chat_template, control_tokens))
        await engine.start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.stop()


@pytest.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    """start_gateway(engine, watchdog_s=..., tracer_provider=..., **GatewayConfig fields) -> a Gateway on
    a free port, ready unless wait_ready=False. Requests wait 0.2 s for a missing engine unless
    engine_wait says."""
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(engine: FakeEngine, *, watchdog_s: float = 3.0, wait_ready: bool = True,
                    tracer_provider: Any = None, **config: Any) -> Gateway:
        config.setdefault("engine_wait", 0.2)
        gateway_config = GatewayConfig(
            engine_addresses=(engine.address,), port=free_port(), engine_timeout=watchdog_s, **config
        )
        app = create_app(gateway_config, tracer_provider=tracer_provider)
        runner = await start_runner(app, shutdown_timeout=1.0)
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", gateway_config.port).start()
        url = f"http://127.0.0.1:{gateway_config.port}"
        http = aiohttp.ClientSession(base_url=url)
        sessions.append(http)
        gateway = Gateway(url, http, app[STATE].pool)
        if wait_ready:
            await wait_until_async(lambda: gateway.client.ready, 5.0, "the gateway to see the engine ready")
        return gateway

    yield start
    for http in sessions:
        await http.close()
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def gateway(fake_engine: FakeEngine, start_gateway: StartGateway) -> Gateway:
    return await start_gateway(fake_engine)
