"""The time a decode step spends in a model's linears, on one thread: what tensor parallelism shares
out N ways, so the step at N ranks can be set against its ideal, the one-rank step less (1 - 1/N)
of its linears' time (`ember bench tp-costs --model`)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from ember_core import LLM


@dataclass(frozen=True)
class LinearsTiming:
    rows: int  # tokens of the step
    linears: int  # how many were timed
    total_ms: float  # the sum of their medians


def _linears(model: nn.Module) -> list[nn.Module]:
    """The model's linear layers as its decode step runs them (the head included): every module
    with in_features and out_features none of whose children has them."""
    def is_linear(module: nn.Module) -> bool:
        return hasattr(module, "in_features") and hasattr(module, "out_features")

    return [m for m in model.modules() if is_linear(m) and not any(is_linear(c) for c in m.children())]


def _median_ms(linear: nn.Module, x: torch.Tensor, repeats: int) -> float:
    linear(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        linear(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def time_linears(model: str, dtype: str, numerics: str, rows: list[int], repeats: int) -> list[LinearsTiming]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _timed(LLM(model, dtype=dtype, numerics=numerics, num_blocks=16).engine.runner.model, rows, repeats)
    finally:
        torch.set_num_threads(threads)


def _timed(loaded: nn.Module, rows: list[int], repeats: int) -> list[LinearsTiming]:
    linears = _linears(loaded)
    weight_dtype = next(p.dtype for p in loaded.parameters() if p.is_floating_point())
    generator = torch.Generator().manual_seed(0)
    timings = []
    for count in rows:
        total = sum(
            _median_ms(linear, torch.randn(count, linear.in_features, generator=generator).to(weight_dtype), repeats) for linear in linears
        )
        timings.append(LinearsTiming(count, len(linears), total))
    return timings
