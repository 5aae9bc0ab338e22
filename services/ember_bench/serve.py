"""`ember bench serve`: replay requests against an OpenAI-compatible /v1/completions endpoint at a
fixed concurrency or a Poisson arrival rate, and summarise what each request saw (and, from an
ember server's /metrics, how many times its engines preempted a sequence meanwhile)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ember_bench.sse_client import stream_completion
from ember_bench.stats import RequestResult, ServeMetrics, summarize
from ember_bench.workload import BenchRequest


@dataclass(frozen=True)
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    # None: the first id GET /v1/models lists; "a,b,...": requests take them in turn (an adapter mix)
    model: str | None = None
    api_key: str | None = None
    concurrency: int | None = None  # None: no cap
    request_rate: float | None = None  # req/s of a Poisson process; None: send all at once
    ignore_eos: bool = False
    timeout_s: float = 300.0
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.request_rate == math.inf:
            object.__setattr__(self, "request_rate", None)
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")

    @property
    def api_root(self) -> str:
        """The server root, whether the URL was given with or without the OpenAI-style /v1."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ServeRun:
    model: str
    metrics: ServeMetrics
    preemptions: int | None = None  # by the server's engines during the run; None: not an ember server


def arrival_offsets(count: int, request_rate: float | None, seed: int) -> list[float]:
    """Send times in seconds from the start: exponential gaps for a Poisson process of that rate."""
    if request_rate is None:
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def run_serve(config: ServeConfig, requests: list[BenchRequest]) -> ServeRun:
    # The limiter below caps concurrency, not aiohttp's default pool of 100 connections; each request
    # has its own deadline (stream_completion), which aiohttp's default 5-minute total must not cut short.
    # A connection per request: a kept-alive one that the server has since closed (llama-server closes
    # idle ones) fails the next POST written to it, a lost request the server never saw.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = config.model or await first_model_id(session, config)
        preempted_before = await engine_preemptions(session, config)
        limiter = asyncio.Semaphore(config.concurrency) if config.concurrency else contextlib.nullcontext()
        url = f"{config.api_root}/v1/completions"
        loop = asyncio.get_running_loop()
        started_at = loop.time()

        models = model.split(",")

        async def issue(index: int, request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(started_at + offset - loop.time())
            payload = _payload(models[index % len(models)], request, config)
            async with limiter:
                return await stream_completion(session, url, payload, config.headers, config.timeout_s)

        offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
        results = await asyncio.gather(*(issue(i, r, offset) for i, (r, offset) in enumerate(zip(requests, offsets))))
        duration_s = loop.time() - started_at
        preempted_after = await engine_preemptions(session, config)
    preemptions = None if preempted_before is None or preempted_after is None else preempted_after - preempted_before
    return ServeRun(model, summarize(results, duration_s, config.slos), preemptions)


async def engine_preemptions(session: aiohttp.ClientSession, config: ServeConfig) -> int | None:
    """ember's preemption counter summed over the server's engines; None where GET /metrics has none."""
    try:
        async with session.get(f"{config.api_root}/metrics", headers=config.headers) as response:
            text = await response.text() if response.status == 200 else ""
    except (aiohttp.ClientError, OSError):
        return None
    # An engine whose first stats have not arrived yet has no sample: it has preempted nothing.
    families = [family for family in text_string_to_metric_families(text) if family.name == "ember_num_preemptions"]
    if not families:
        return None
    return int(sum(sample.value for sample in families[0].samples if sample.name == "ember_num_preemptions_total"))


async def first_model_id(session: aiohttp.ClientSession, config: ServeConfig) -> str:
    url = f"{config.api_root}/v1/models"
    try:
        body = await asyncio.wait_for(_get_json(session, url, config.headers), config.timeout_s)
        return body["data"][0]["id"]
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError, LookupError, TypeError) as exc:
        raise ConnectionError(f"cannot get a model id from {url} ({type(exc).__name__}: {exc}); pass --model") from None


async def _get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Any:
    async with session.get(url, headers=headers) as response:
        response.raise_for_status()
        return await response.json(content_type=None)


def _payload(model: str, request: BenchRequest, config: ServeConfig) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload
