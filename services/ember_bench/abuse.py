"""`ember bench abuse`: a fresh `ember serve` on loopback under the attacks an exposed gateway meets,
each bounded in count and time: slowloris (header bytes trickled), slow and oversized bodies, idle
connections, a disconnect storm, then a soak at moderate load. Reported: connections the server
still holds after each attack's timeout, a normal request's latency during the slowloris against
quiet, how long the engine kept computing after the storm, requests lost, and the RSS and open
file descriptors of every process at the start and the end of each round."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from ember_bench.local_server import local_server, served_model


@dataclass(frozen=True)
class AbuseSetup:
    model: str
    slow_connections: int = 400
    idle_connections: int = 200
    slow_bodies: int = 100
    storm_requests: int = 100
    soak_s: float = 60.0
    soak_concurrency: int = 8
    rounds: int = 2
    serve_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class AbuseRound:
    processes_start: dict[str, dict[str, int]]  # per process: rss_kib, fds
    processes_end: dict[str, dict[str, int]]
    phases: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class AbuseReport:
    setup: AbuseSetup
    rounds: list[AbuseRound]


def run_abuse(setup: AbuseSetup) -> AbuseReport:
    """The attacks setup.rounds times on one server: the first round touches what a first load
    touches (the KV pool's pages, allocator arenas), so later rounds show whether anything grows."""
    rounds = []
    with local_server(setup.model, 1, list(setup.serve_args)) as (url, process):
        model = served_model(url)
        for _ in range(setup.rounds):
            start = _process_usage(process.pid)
            phases = asyncio.run(_attacks(url, model, setup))
            time.sleep(2.0)  # let closed connections and finished requests settle
            rounds.append(AbuseRound(start, _process_usage(process.pid), phases))
    return AbuseReport(setup, rounds)


async def _attacks(url: str, model: str, setup: AbuseSetup) -> dict[str, dict[str, Any]]:
    host, port = url.removeprefix("http://").split(":")
    address = (host, int(port))
    phases: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession() as session:
        probe = _Probe(session, url, model)
        quiet = await probe.latencies(10)
        phases["quiet"] = {"latency_p50_s": _p50(quiet)}
        phases["slowloris"] = await _held_open(
            address, setup.slow_connections, _trickle_headers, during=lambda: probe.latencies(10), quiet=quiet
        )
        phases["slow_bodies"] = await _slow_bodies(address, setup.slow_bodies)
        phases["idle"] = await _held_open(address, setup.idle_connections, _stay_idle)
        phases["disconnect_storm"] = await _storm(session, url, model, setup.storm_requests)
        phases["soak"] = await _soak(session, url, model, setup.soak_s, setup.soak_concurrency)
        phases["after"] = {"latency_p50_s": _p50(await probe.latencies(10))}
    return phases


@dataclass
class _Probe:
    """A normal request: a short greedy completion, timed from send to its whole answer."""

    session: aiohttp.ClientSession
    url: str
    model: str

    async def latencies(self, count: int) -> list[float]:
        out = []
        for _ in range(count):
            started = time.monotonic()
            body = {"model": self.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
            async with self.session.post(f"{self.url}/v1/completions", json=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"a normal request failed during the attack: {response.status}")
            out.append(time.monotonic() - started)
        return out


async def _trickle_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + b"X-Slow: a\r\n" * 1000
    for byte in request:
        writer.write(bytes([byte]))
        await asyncio.sleep(0.2)


async def _stay_idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)


async def _held_open(
    address: tuple[str, int],
    count: int,
    behave: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    during: Callable[[], Awaitable[list[float]]] | None = None,
    quiet: list[float] | None = None,
    limit_s: float = 120.0,
) -> dict[str, Any]:
    """count connections behaving so; seconds until the server closed each (None: never, within limit_s)."""
    started = time.monotonic()
    closed_after: list[float | None] = []

    async def one() -> None:
        reader, writer = await asyncio.open_connection(*address)
        acting = asyncio.create_task(behave(reader, writer))
        try:  # b"" or an error body, or a reset once the server closed and a byte more was sent
            await asyncio.wait_for(reader.read(), limit_s)
            closed_after.append(time.monotonic() - started)
        except ConnectionError:
            closed_after.append(time.monotonic() - started)
        except TimeoutError:
            closed_after.append(None)
        finally:
            acting.cancel()
            writer.close()

    attackers = [asyncio.create_task(one()) for _ in range(count)]
    await asyncio.sleep(1.0)  # all connected
    result: dict[str, Any] = {"connections": count}
    if during is not None and quiet is not None:
        latencies = await during()
        result |= {"latency_p50_s": _p50(latencies), "latency_vs_quiet": _p50(latencies) / _p50(quiet)}
    await asyncio.gather(*attackers)
    closed = [t for t in closed_after if t is not None]
    return result | {
        "closed_by_server": len(closed),
        "still_open": count - len(closed),
        "closed_after_s_max": max(closed, default=0.0),
    }


async def _slow_bodies(address: tuple[str, int], count: int) -> dict[str, Any]:
    """Half declare a 10 MB body (refused before it is read), half stall after 1 KB of a 100 KB one."""
    statuses: list[int] = []
    seconds: list[float] = []

    async def one(declared: int) -> None:
        reader, writer = await asyncio.open_connection(*address)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {declared}\r\n\r\n").encode()
        started = time.monotonic()
        writer.write(head + b" " * 1024)
        try:
            response = await asyncio.wait_for(reader.read(), 60.0)
            statuses.append(int(response.split(b" ", 2)[1]) if response else 0)
        except (TimeoutError, ConnectionError, ValueError, IndexError):
            statuses.append(0)
        seconds.append(time.monotonic() - started)
        writer.close()

    await asyncio.gather(*(one(10_000_000 if i % 2 else 100_000) for i in range(count)))
    return {
        "connections": count,
        "answered": {str(code): statuses.count(code) for code in sorted(set(statuses))},
        "closed_after_s_max": max(seconds, default=0.0),
    }


async def _storm(session: aiohttp.ClientSession, url: str, model: str, count: int) -> dict[str, Any]:
    """count long requests (half streamed) whose clients leave after a second; then how long until
    the engine runs none."""
    async def leave(stream: bool) -> None:
        body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 256, "ignore_eos": True,
                "stream": stream}
        try:
            async with session.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                await r.read()
        except (TimeoutError, aiohttp.ClientError):
            pass

    await asyncio.gather(*(leave(i % 2 == 0) for i in range(count)))
    left_at = time.monotonic()
    while (running := await _gauge(session, url, "ember_num_requests_running")) > 0:
        if time.monotonic() - left_at > 60:
            break
        await asyncio.sleep(0.1)
    return {"requests": count, "engine_idle_after_s": time.monotonic() - left_at, "running_at_end": running,
            "kv_blocks_used_at_end": await _gauge(session, url, "ember_kv_cache_usage_perc")}


async def _soak(session: aiohttp.ClientSession, url: str, model: str, seconds: float, concurrency: int) -> dict[str, Any]:
    """Mixed requests (streamed or not, chat or completions) from `concurrency` clients for `seconds`."""
    outcomes: dict[str, int] = {"ok": 0, "http_error": 0, "lost": 0}
    rng = random.Random(0)
    deadline = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < deadline:
            stream, chat = rng.random() < 0.5, rng.random() < 0.5
            fields = {"model": model, "max_tokens": rng.randint(8, 48), "stream": stream, "temperature": 0.7}
            path, body = (("/v1/chat/completions", {**fields, "messages": [{"role": "user", "content": "Hi!"}]})
                          if chat else ("/v1/completions", {**fields, "prompt": "Once upon a time"}))
            try:
                async with session.post(f"{url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
                    text = await r.text()
                    complete = r.status == 200 and (not stream or text.rstrip().endswith("data: [DONE]"))
                    outcomes["ok" if complete else "http_error"] += 1
            except (TimeoutError, aiohttp.ClientError):
                outcomes["lost"] += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"seconds": seconds, "concurrency": concurrency, **outcomes}


async def _gauge(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _process_usage(root: int) -> dict[str, dict[str, int]]:
    """RSS (KiB) and open descriptors of the launcher and every process below it, by command name."""
    usage = {}
    for pid in _process_tree(root):
        try:
            proc = Path(f"/proc/{pid}")
            name = " ".join(proc.joinpath("cmdline").read_text().split("\0")[1:4]).strip() or str(pid)
            status = proc.joinpath("status").read_text().splitlines()
            rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            usage[f"{pid} {name}"] = {"rss_kib": rss, "fds": len(os.listdir(proc / "fd"))}
        except (OSError, StopIteration):
            continue
    return usage


def _process_tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            todo += [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            continue
    return pids


def _p50(values: list[float]) -> float:
    return float(np.percentile(values, 50))


def abuse_summary(report: AbuseReport) -> str:
    lines = []
    for number, round_ in enumerate(report.rounds, 1):
        lines.append(f"round {number}")
        lines += [f"  {phase:<18}" + ", ".join(f"{k}={_fmt(v)}" for k, v in result.items())
                  for phase, result in round_.phases.items()]
        lines.append("  process                                   rss MiB start -> end   fds start -> end")
        for name, start in round_.processes_start.items():
            end = round_.processes_end.get(name, {"rss_kib": 0, "fds": 0})
            lines.append(f"  {name[:40]:<42}{start['rss_kib'] / 1024:>8.1f} -> {end['rss_kib'] / 1024:<8.1f}"
                         f"{start['fds']:>8} -> {end['fds']}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
