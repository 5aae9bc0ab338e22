"""`ember bench routing`: the same conversations through `ember serve --data-parallel-size N`
at each arrival rate under each routing mode, one fresh server (cold caches) per pair, in one run.
Per pair: prompt tokens the engines computed (looked up in their prefix caches and not found, from
/metrics), the hit rate, TTFT p50/p90 and output throughput, each ratio against round-robin at the
same rate. A sweep of rates shows routing where the engines keep up and where they fall behind."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from ember_bench.conversations import ConversationWorkload, TurnResult, run_conversations
from ember_bench.local_server import local_server, served_model


@dataclass(frozen=True)
class RoutingSetup:
    model: str
    data_parallel_size: int = 2
    extra_serve_args: tuple[str, ...] = ()  # more `ember serve` flags, e.g. --kv-cache-mib
    timeout_s: float = 600.0
    concurrency: int | None = None
    user_rates: tuple[float | None, ...] = (None,)  # conversations starting per second; None: all at once
    seed: int = 0


@dataclass(frozen=True)
class RoutingRun:
    routing: str
    user_rate: float | None
    turns: int
    failed: int
    duration_s: float
    prompt_tokens: int  # looked up in the engines' prefix caches
    cached_tokens: int  # found there
    preemptions: int  # in the engines, sequences put back to recompute when their pool ran out
    ttft_p50_ms: float
    ttft_p90_ms: float
    output_throughput: float
    decisions: dict[str, float]  # the gateway's routing decisions by reason

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_routing(setup: RoutingSetup, workload: ConversationWorkload, modes: list[str]) -> Iterator[RoutingRun]:
    for user_rate in setup.user_rates:
        for routing in modes:
            with _server(setup, routing) as (url, _):
                started = time.monotonic()
                turns = asyncio.run(run_conversations(
                    url, served_model(url), workload, setup.timeout_s, setup.concurrency, user_rate, setup.seed
                ))
                duration = time.monotonic() - started
                yield _summary(routing, user_rate, turns, duration, _metrics(url))


def _server(setup: RoutingSetup, routing: str) -> AbstractContextManager[tuple[str, subprocess.Popen]]:
    serve_args = ["--data-parallel-size", str(setup.data_parallel_size), "--routing", routing, *setup.extra_serve_args]
    return local_server(setup.model, setup.data_parallel_size, serve_args)


def _metrics(url: str) -> dict[str, dict[str, float]]:
    """Each series summed over its labels but one: {name: {label value: total}}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, dict[str, float]] = {}
    for name, labels, value in re.findall(r"^(ember_\w+?)(?:\{(.*)\})? (\S+)$", text, flags=re.MULTILINE):
        reason = re.search(r'reason="(\w+)"', labels)
        key = reason[1] if reason else ""
        totals.setdefault(name, {}).setdefault(key, 0.0)
        totals[name][key] += float(value)
    return totals


def _summary(
    routing: str, user_rate: float | None, turns: list[TurnResult], duration: float, metrics: dict[str, dict[str, float]]
) -> RoutingRun:
    done = [turn.result for turn in turns if turn.result.success]
    ttfts = np.asarray([result.ttft for result in done] or [0.0]) * 1e3
    return RoutingRun(
        routing=routing,
        user_rate=user_rate,
        turns=len(done),
        failed=len(turns) - len(done),
        duration_s=duration,
        prompt_tokens=int(metrics.get("ember_prefix_cache_queries_total", {}).get("", 0)),
        cached_tokens=int(metrics.get("ember_prefix_cache_hits_total", {}).get("", 0)),
        preemptions=int(metrics.get("ember_num_preemptions_total", {}).get("", 0)),
        ttft_p50_ms=float(np.percentile(ttfts, 50)),
        ttft_p90_ms=float(np.percentile(ttfts, 90)),
        output_throughput=sum(result.output_tokens for result in done) / duration,
        decisions=metrics.get("ember_routing_decisions_total", {}),
    )


def rate_label(user_rate: float | None) -> str:
    return "all" if user_rate is None else f"{user_rate:g}/s"


def routing_table(runs: list[RoutingRun]) -> str:
    """One line a run; the ratios against round-robin's run at the same rate (or the rate's first run)."""
    header = (f"{'rate':>6} {'routing':<13}{'turns':>6}{'failed':>7}{'computed':>10}{'x rr':>6}{'hit rate':>9}"
              f"{'TTFT p50':>10}{'x rr':>6}{'TTFT p90':>10}{'tok/s':>8}{'preempt':>8}")
    lines = [header]
    for run in runs:
        same_rate = [other for other in runs if other.user_rate == run.user_rate]
        baseline = next((other for other in same_rate if other.routing == "round-robin"), same_rate[0])
        lines.append(
            f"{rate_label(run.user_rate):>6} {run.routing:<13}{run.turns:>6}{run.failed:>7}{run.computed_tokens:>10}"
            f"{run.computed_tokens / max(baseline.computed_tokens, 1):>6.2f}{run.hit_rate:>9.1%}"
            f"{run.ttft_p50_ms:>10.0f}{run.ttft_p50_ms / max(baseline.ttft_p50_ms, 1e-9):>6.2f}"
            f"{run.ttft_p90_ms:>10.0f}{run.output_throughput:>8.1f}{run.preemptions:>8}"
        )
    return "\n".join(lines)
