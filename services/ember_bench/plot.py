"""A PNG of offline runs: throughput and latency against concurrency, one line per configuration (its
median round where there were several)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # a bare Figure renders with Agg and never touches a GUI backend

from ember_bench.offline_runs import OfflineRun
from ember_bench.report import median_runs


def plot_offline(runs: list[OfflineRun], path: str | Path, title: str) -> None:
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    throughput_axes, latency_axes = figure.subplots(1, 2)
    runs = median_runs(runs)
    for name in dict.fromkeys(run.name for run in runs):
        series = sorted((run for run in runs if run.name == name), key=lambda run: run.concurrency)
        concurrency = [run.concurrency for run in series]
        (line,) = throughput_axes.plot(concurrency, [run.output_throughput for run in series], marker="o", label=name)
        color = line.get_color()
        latency_axes.plot(concurrency, [run.latency_ms.median / 1e3 for run in series], marker="o", color=color)
        latency_axes.plot(concurrency, [run.latency_ms.p99 / 1e3 for run in series], linestyle="--", color=color)
    ticks = sorted({run.concurrency for run in runs})
    latency_label = "request latency (s): p50 solid, p99 dashed"
    for axes, ylabel in ((throughput_axes, "output tokens / s"), (latency_axes, latency_label)):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [str(tick) for tick in ticks])
        axes.minorticks_off()
        axes.set_xlabel("concurrency (max_num_seqs / batch size)")
        axes.set_ylabel(ylabel)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
    throughput_axes.legend(fontsize="small")
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
