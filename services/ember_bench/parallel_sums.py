"""`ember bench tp-sums`: what one sum across tensor-parallel ranks costs, the collective a split
layer calls twice: N ranks on this host (one thread each), adding [rows, hidden] float32 parts in
rank order, through the shared-memory segment the engine uses and through gloo's all-gather."""

from __future__ import annotations

import multiprocessing
import statistics
import time
from dataclasses import dataclass, replace

import torch

from ember_core.parallel.group import TensorParallel, join, leave
from ember_core.parallel.ranks import free_port
from ember_core.parallel.shared_exchange import SharedExchange

PATHS = ("shared memory", "gloo")


@dataclass(frozen=True)
class SumTiming:
    path: str  # one of PATHS
    rows: int
    hidden: int
    median_us: float


def _timed_sum(parallel: TensorParallel, rows: int, hidden: int, repeats: int) -> float:
    """The median microseconds of a sum, every rank's result checked."""
    part = torch.full((rows, hidden), float(parallel.rank + 1))
    for _ in range(10):  # warm-up
        parallel.sum(part)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        total = parallel.sum(part)
        times.append(time.perf_counter() - start)
    if not torch.all(total == parallel.world_size * (parallel.world_size + 1) / 2):
        raise RuntimeError("the ranks' sum is wrong")
    return statistics.median(times) * 1e6


def _rank(rank: int, world_size: int, address: str, shapes: list[tuple[int, int]], repeats: int) -> list[SumTiming]:
    torch.set_num_threads(1)
    parallel = join(rank, world_size, address)
    exchange = SharedExchange(0, world_size) if rank == 0 else None
    name = parallel.broadcast(None if exchange is None else exchange.name)
    exchange = exchange or SharedExchange(rank, world_size, name)
    try:
        return [
            SumTiming(path, rows, hidden, _timed_sum(ranks, rows, hidden, repeats))
            for path, ranks in zip(PATHS, (replace(parallel, exchange=exchange), parallel))
            for rows, hidden in shapes
        ]
    finally:
        leave()
        exchange.close()


def measure_sums(world_size: int, shapes: list[tuple[int, int]], repeats: int) -> list[SumTiming]:
    """Rank 0 in this process, the others started here; rank 0's timings."""
    address = f"127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    followers = [context.Process(target=_rank, args=(r, world_size, address, shapes, repeats)) for r in range(1, world_size)]
    for process in followers:
        process.start()
    try:
        return _rank(0, world_size, address, shapes, repeats)
    finally:
        for process in followers:
            process.join(timeout=30)


def sums_table(timings: list[SumTiming]) -> str:
    lines = [f"{'path':<14} {'rows':>5} {'hidden':>7} {'median us':>10}"]
    lines += [f"{t.path:<14} {t.rows:>5} {t.hidden:>7} {t.median_us:>10.1f}" for t in timings]
    return "\n".join(lines)
