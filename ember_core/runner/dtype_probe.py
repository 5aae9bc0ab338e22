"""`--dtype auto` on a CPU with native bfloat16 (AVX512-BF16, AMX): bfloat16 only where this
machine runs the model's own linears faster in it than in float32. Native instructions are not
enough: the float32 path has ember's tuned kernels, and how much bfloat16 gains depends on the
CPU (AMX tiles, or only vdpbf16ps), on the layer shapes and on the format the weights run from: a
GGUF model's blocks are widened to bfloat16 or to float32 as they are read, at a cost of its own.
The probe times one decoder layer's linears as the model will run them (its GGUF blocks, or dense
weights of its shapes) at a decode step's rows in both dtypes, through the paths each would take
here, in a few milliseconds at start, and logs the figures with the choice. A mixture of experts'
layer is timed whole: its experts (their blocks, or dense experts of their shapes) behind a random
router, which spreads the step's rows over them as a trained one does."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from torch import nn

from ember_core.device import cpu_has_fast_bf16, resolve_dtype
from ember_core.layers.linear import PLAIN_WEIGHT_FORMAT, GGUFBlockLinear, StackedBlockLinear, use_small_batch_linears
from ember_core.layers.moe import SparseMoE
from ember_core.loaders.materialize import DtypeChoice

logger = logging.getLogger(__name__)

PROBE_ROWS = 16  # a decode step of 16 sequences
PROBE_REPEATS = 3


def dtype_for_model(dtype: str | torch.dtype | None, device: torch.device) -> DtypeChoice:
    """resolve_dtype's answer, except "auto" on a CPU with native bfloat16: the model's shapes decide
    (faster_cpu_dtype, called by the loader on the model built without weights)."""
    if dtype in (None, "auto") and device.type == "cpu" and cpu_has_fast_bf16():
        return faster_cpu_dtype
    return resolve_dtype(dtype, device)


def _layer_linears(model: nn.Module) -> list[nn.Module]:
    """The linears of the model's first decoder layer (or its mixture of experts, whole): GGUF block
    linears where the loader put the file's blocks on the model, else its nn.Linears (on the meta
    device: shapes only)."""
    layer = next(module for module in model.modules() if isinstance(module, nn.ModuleList))[0]

    def linears(module: nn.Module) -> list[nn.Module]:
        found = []
        for child in module.children():
            probed = isinstance(child, (nn.Linear, GGUFBlockLinear, StackedBlockLinear, SparseMoE))
            found.extend([child] if probed else linears(child))
        return found

    return linears(layer)


def _runnable(linear: nn.Module, dtype: torch.dtype) -> nn.Module:
    """What a model in dtype runs for linear, without its bias: the same blocks, or a dense weight of its shape."""
    if isinstance(linear, GGUFBlockLinear):
        return GGUFBlockLinear(linear.blocks, linear.kind, linear.in_features, None)
    if isinstance(linear, StackedBlockLinear):
        return StackedBlockLinear([_runnable(part, dtype) for part in linear.parts], None)
    if isinstance(linear, SparseMoE):
        return _runnable_experts(linear, dtype)
    return nn.Linear(linear.in_features, linear.out_features, bias=False, dtype=dtype)


def _runnable_experts(moe: SparseMoE, dtype: torch.dtype) -> SparseMoE:
    """moe's experts (its blocks, or dense experts of their shapes: only as many as a probe step can
    select) behind a random router and shared expert, in dtype."""
    experts = moe.experts
    blocks = experts.gate_up_format != PLAIN_WEIGHT_FORMAT
    num_experts = moe.config.num_experts if blocks else min(moe.config.num_experts, PROBE_ROWS * moe.config.top_k)
    config = dataclasses.replace(moe.config, num_experts=num_experts)
    with torch.device("meta"):
        runnable = SparseMoE(config, moe.hidden_size, experts.activation)
    if blocks:
        runnable.experts.keep_blocks(experts.gate_up_proj, experts.gate_up_format, experts.down_proj, experts.down_format)
    generator = torch.Generator().manual_seed(0)
    for module in runnable.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            values = torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5
            setattr(module, name, nn.Parameter(values.to(dtype), requires_grad=False))
    return runnable


def _probe_input_size(module: nn.Module) -> int:
    return module.hidden_size if isinstance(module, SparseMoE) else module.in_features


def _seconds_per_pass(linears: list[nn.Module], dtype: torch.dtype) -> float:
    generator = torch.Generator().manual_seed(0)
    runnable = nn.ModuleList(_runnable(linear, dtype) for linear in linears)
    if any(type(module) is nn.Linear for module in runnable.modules()):
        use_small_batch_linears(runnable)  # the path a model in this dtype takes here
    inputs = [torch.randn(PROBE_ROWS, _probe_input_size(linear), generator=generator).to(dtype) for linear in linears]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(1 + PROBE_REPEATS):  # the first pass warms caches and builds
            start = time.perf_counter()
            for linear, x in zip(runnable, inputs):
                linear(x)
            best = min(best, time.perf_counter() - start)
    return best


def faster_cpu_dtype(model: nn.Module) -> torch.dtype:
    """bfloat16 if a decoder layer's linears run faster in it here than in float32, else float32."""
    linears = _layer_linears(model)
    float32, bfloat16 = _seconds_per_pass(linears, torch.float32), _seconds_per_pass(linears, torch.bfloat16)
    choice = torch.bfloat16 if bfloat16 < float32 else torch.float32
    logger.info(
        "dtype auto: %s (a decoder layer's linears at %d rows: float32 %.2f ms, bfloat16 %.2f ms)",
        str(choice).removeprefix("torch."), PROBE_ROWS, float32 * 1e3, bfloat16 * 1e3,
    )
    return choice
