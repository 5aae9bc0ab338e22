"""Statistics with vLLM's definitions: percentiles, TPOT, goodput and the summary built on them."""

from __future__ import annotations

import pytest

from ember_bench.stats import Distribution, RequestResult, meets_slos, parse_slos, summarize, tpot


def ok(output_tokens: int, ttft: float, latency: float, prompt_tokens: int = 10) -> RequestResult:
    gaps = [(latency - ttft) / (output_tokens - 1)] * (output_tokens - 1) if output_tokens > 1 else []
    return RequestResult(True, "", prompt_tokens, output_tokens, ttft, latency, gaps)


def test_distribution_uses_linear_percentiles() -> None:
    dist = Distribution.of(list(range(1, 101)))
    assert dist == Distribution(mean=50.5, median=50.5, p99=pytest.approx(99.01))
    assert Distribution.of([0.25], scale=1e3) == Distribution(250.0, 250.0, 250.0)
    assert Distribution.of([]) is None


def test_tpot_excludes_the_first_token() -> None:
    assert tpot(ok(output_tokens=5, ttft=0.1, latency=0.5)) == pytest.approx(0.1)
    assert tpot(ok(output_tokens=1, ttft=0.1, latency=0.1)) is None


def test_summary_counts_only_completed_requests() -> None:
    failed = RequestResult(error="HTTP 500: boom")
    results = [ok(5, 0.1, 0.5), ok(1, 0.2, 0.2), ok(3, 0.3, 0.7), failed]
    metrics = summarize(results, duration_s=2.0, slos={})
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert metrics.output_tokens == 9 and metrics.input_tokens == 30
    assert metrics.request_throughput == 1.5
    assert metrics.output_throughput == 4.5 and metrics.total_token_throughput == 19.5
    assert metrics.ttft_ms.mean == pytest.approx(200.0)
    # TPOT only over requests with more than one token: 100 ms and 200 ms.
    assert metrics.tpot_ms.mean == pytest.approx(150.0)
    assert metrics.itl_ms.mean == pytest.approx((4 * 100 + 2 * 200) / 6)
    assert metrics.e2e_ms.median == pytest.approx(500.0)
    assert metrics.goodput is None and metrics.errors == ["HTTP 500: boom"]


def test_summary_keeps_the_first_few_errors() -> None:
    results = [RequestResult(error=f"error {i}") for i in range(8)]
    metrics = summarize(results, duration_s=1.0, slos={})
    assert metrics.completed == 0 and metrics.errors == [f"error {i}" for i in range(5)]
    assert metrics.ttft_ms is None and metrics.output_throughput == 0


def test_goodput_needs_every_slo_met() -> None:
    results = [ok(5, 0.1, 0.5), ok(5, 0.4, 0.8), ok(5, 0.1, 2.1), ok(1, 0.1, 0.1), RequestResult(error="x")]
    slos = parse_slos(["ttft:300", "tpot:150", "e2e:1000"])
    # The second misses TTFT, the third misses TPOT and e2e; a one-token output has TPOT 0.
    assert [meets_slos(r, slos) for r in results] == [True, False, False, True, False]
    assert summarize(results, duration_s=4.0, slos=slos).goodput == 0.5


def test_parse_slos() -> None:
    assert parse_slos(["ttft:500", "e2e:1e4"]) == {"ttft": 500.0, "e2e": 10000.0}
    assert parse_slos([]) == {}
    for bad in ("latency:5", "ttft", "ttft:fast", "tpot:0", "tpot:-1"):
        with pytest.raises(ValueError, match="bad --goodput spec"):
            parse_slos([bad])
