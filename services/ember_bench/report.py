"""Human-readable tables and JSON files for benchmark results."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ember_bench.offline_runs import OfflineRun
from ember_bench.stats import Distribution, ServeMetrics

WIDTH = 60


def serve_table(model: str, metrics: ServeMetrics, slos: dict[str, float], preemptions: int | None = None) -> str:
    rows = [
        ("Model", model),
        ("Completed requests", metrics.completed),
        ("Failed requests", metrics.failed),
        ("Duration (s)", f"{metrics.duration_s:.2f}"),
        ("Input tokens (from usage)", metrics.input_tokens),
        ("Output tokens", metrics.output_tokens),
        ("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}"),
    ]
    if preemptions is not None:
        rows.append(("Engine preemptions (during the run)", preemptions))
    if metrics.goodput is not None:
        limits = " ".join(f"{name}<={limit:g}ms" for name, limit in slos.items())
        rows.append((f"Goodput (req/s, {limits})", f"{metrics.goodput:.2f}"))
    lines = [" Serving benchmark ".center(WIDTH, "=")]
    lines += [f"{label + ':':<40}{value:>{WIDTH - 40}}" for label, value in rows]
    lines.append(f"{'latency (ms)':<24}{'mean':>12}{'median':>12}{'p99':>12}")
    latencies = {"TTFT": metrics.ttft_ms, "TPOT": metrics.tpot_ms, "ITL": metrics.itl_ms, "E2E": metrics.e2e_ms}
    lines += [f"{label:<24}" + _distribution_cells(dist) for label, dist in latencies.items()]
    if metrics.errors:
        lines.append(f"First errors ({len(metrics.errors)} of {metrics.failed}):")
        lines += [f"  {error}" for error in metrics.errors]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _distribution_cells(dist: Distribution | None) -> str:
    if dist is None:
        return f"{'n/a':>12}" * 3
    return f"{dist.mean:>12.2f}{dist.median:>12.2f}{dist.p99:>12.2f}"


def write_json(path: str | Path, payload: Any) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, default=_dataclass_fields) + "\n")


def _dataclass_fields(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


OFFLINE_HEADER = (
    f"{'configuration':<52}{'round':>6}{'conc':>5}{'reqs':>6}{'tokens':>8}{'time s':>9}{'tok/s':>9}{'req/s':>8}"
    f"{'lat mean':>10}{'p50':>9}{'p99':>9}{'preempt':>9}"
)


def offline_table(runs: list[OfflineRun]) -> str:
    lines = [OFFLINE_HEADER, "-" * len(OFFLINE_HEADER), *map(offline_row, runs)]
    medians = median_runs(runs)
    if len(medians) < len(runs):
        lines += ["", "the median round of each configuration (by tok/s):", OFFLINE_HEADER, "-" * len(OFFLINE_HEADER)]
        lines += map(offline_row, medians)
    lines.append("latency: seconds from the start of the batch until the request finished")
    return "\n".join(lines)


def offline_row(run: OfflineRun) -> str:
    latency = run.latency_ms
    preemptions = "-" if run.num_preemptions is None else str(run.num_preemptions)
    return (
        f"{run.name:<52}{run.round:>6}{run.concurrency:>5}{run.num_requests:>6}{run.output_tokens:>8}{run.duration_s:>9.2f}"
        f"{run.output_throughput:>9.1f}{run.request_throughput:>8.2f}"
        f"{latency.mean / 1e3:>10.2f}{latency.median / 1e3:>9.2f}{latency.p99 / 1e3:>9.2f}{preemptions:>9}"
    )


def median_runs(runs: list[OfflineRun]) -> list[OfflineRun]:
    """Per configuration and concurrency, in first-seen order, the run of median output throughput (the
    lower middle for an even count): a run that happened, so its latencies match its throughput."""
    groups: dict[tuple[str, int], list[OfflineRun]] = {}
    for run in runs:
        groups.setdefault((run.name, run.concurrency), []).append(run)
    medians = []
    for group in groups.values():
        ranked = sorted(group, key=lambda run: run.output_throughput)
        medians.append(ranked[(len(ranked) - 1) // 2])
    return medians
