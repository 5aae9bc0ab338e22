"""Per-request measurements and their summaries, with vLLM's benchmark definitions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2e")
MAX_REPORTED_ERRORS = 5


@dataclass
class RequestResult:
    """One streamed request; times in seconds from when it was sent."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0  # e2e: until the last content chunk arrived
    itl: list[float] = field(default_factory=list)
    text: str = ""  # what the stream said, for a conversation's next turn
    token_ids: list[int] = field(default_factory=list)  # the generated ids, where return_token_ids asked for them


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first; undefined for a single-token output."""
    if result.output_tokens <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1.0) -> Distribution | None:
        if len(values) == 0:
            return None
        array = np.asarray(values, dtype=np.float64) * scale
        return cls(float(array.mean()), float(np.percentile(array, 50)), float(np.percentile(array, 99)))


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2e:10000` (milliseconds, any subset) -> {"ttft": 500.0, ...}."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad --goodput spec {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput spec {spec!r}: {value!r} is not a number of milliseconds") from None
        if not slos[name] > 0:
            raise ValueError(f"bad --goodput spec {spec!r}: the limit must be > 0 ms")
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    # As in vLLM, a single-token output has TPOT 0 for goodput purposes.
    measured_ms = {"ttft": result.ttft * 1e3, "tpot": (tpot(result) or 0.0) * 1e3, "e2e": result.latency * 1e3}
    return result.success and all(measured_ms[name] <= limit for name, limit in slos.items())


@dataclass(frozen=True)
class ServeMetrics:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None
    goodput: float | None  # req/s meeting every SLO; None when no SLO was given
    errors: list[str]  # the first few failure messages


def summarize(results: Sequence[RequestResult], duration_s: float, slos: dict[str, float]) -> ServeMetrics:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    tpots = [t for t in map(tpot, done) if t is not None]
    return ServeMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(done) * per_second,
        output_throughput=output_tokens * per_second,
        total_token_throughput=(input_tokens + output_tokens) * per_second,
        ttft_ms=Distribution.of([r.ttft for r in done], 1e3),
        tpot_ms=Distribution.of(tpots, 1e3),
        itl_ms=Distribution.of([gap for r in done for gap in r.itl], 1e3),
        e2e_ms=Distribution.of([r.latency for r in done], 1e3),
        goodput=sum(meets_slos(r, slos) for r in done) * per_second if slos else None,
        errors=[r.error for r in results if not r.success][:MAX_REPORTED_ERRORS],
    )
