"""`--dtype auto` on a CPU: a rule, not a race. The dtype follows from what is known before any
timing (the kernels' build, whether the CPU has AMX, the numerics and the weights' format) through
the table below, whose rows cite the figures in docs/benchmarks.md that justify them. The same
machine, model and flags give the same dtype on every start, however busy the machine is: a
stopwatch at start-up once picked float32 after one restart and bfloat16 after the next.

A row picks bfloat16 only where it was measured at least BFLOAT16_GAIN times float32's throughput:
its rounding moves a model's outputs (SmolLM2 exact bfloat16: KL 0.001 from float32), which a few
percent of speed does not buy.

A new row comes from a measurement: `EMBER_CPU_ISA=BUILD ember bench offline --compare dtype
--numerics N [--gguf-weights dequantized]` times both dtypes in one run and prints the row this
table picks beside the ratio it measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from ember_core.device import resolve_dtype
from ember_core.kernels import cpu_ops
from ember_core.numerics import ResolvedNumerics

logger = logging.getLogger(__name__)

WeightsFormat = Literal["gguf-blocks", "dense"]  # a GGUF file's quantized blocks run as stored, or float weights
DtypeChoice = torch.dtype | Literal["auto"]  # "auto" on a CPU: this table's answer, once numerics and weights are known
_AMX_FLAG = "amx_bf16"
BFLOAT16_GAIN = 1.2
_SECTION = "docs/benchmarks.md, "


@dataclass(frozen=True)
class DtypeFacts:
    """What `auto` is decided by."""

    build: str  # cpu_ops.build_in_use(): the kernels' instruction set, or "torch" without them
    cpu_has_amx: bool
    numerics: ResolvedNumerics
    weights: WeightsFormat


@dataclass(frozen=True)
class AutoDtypeRow:
    """Facts a row matches (None / (): any) and the dtype it picks, with the figures that justify it."""

    dtype: torch.dtype
    evidence: str
    numerics: ResolvedNumerics | None = None
    builds: tuple[str, ...] = ()
    cpu_has_amx: bool | None = None

    def matches(self, facts: DtypeFacts) -> bool:
        return (
            self.numerics in (None, facts.numerics)
            and (not self.builds or facts.build in self.builds)
            and self.cpu_has_amx in (None, facts.cpu_has_amx)
        )


# First match wins; the last row matches everything.
AUTO_DTYPE_TABLE = (
    AutoDtypeRow(
        torch.float32, numerics="fast",
        evidence=_SECTION + "'Zen 4: the fast numerics against llama.cpp': fast in bfloat16 moves SmolLM2 Q4_1 "
        "further from float32 (KL 0.003751) than fast in float32 (0.002669) or llama.cpp (0.002768), and the int8 "
        "linears gain it little (1.07-1.13x on AMX: 'Sapphire Rapids: the dtype table, build by build')",
    ),
    AutoDtypeRow(
        torch.bfloat16, builds=("amx",),
        evidence=_SECTION + "'Sapphire Rapids: the dtype table, build by build': AMX-BF16 tiles run exact bfloat16 "
        "1.52-1.74x float32 at 16 sequences from GGUF blocks, 2.07-2.09x from dense weights",
    ),
    AutoDtypeRow(
        torch.float32, builds=("avx512bf16",), cpu_has_amx=True,
        evidence=_SECTION + "'Sapphire Rapids: the dtype table, build by build': an AMX CPU made to run the "
        "avx512bf16 build issues one vdpbf16ps a cycle against two float32 FMAs: bfloat16 0.94-0.96x float32 "
        "from GGUF blocks, 1.17-1.23x (median 1.19x) from dense weights",
    ),
    AutoDtypeRow(
        torch.bfloat16, builds=("avx512bf16",),
        evidence=_SECTION + "'Zen 4: against llama.cpp's llama-server, and bfloat16 over float32': exact bfloat16 "
        "1.42x float32 offline at 16 sequences (medians 301.8 vs 212.4 tok/s), 1.28-1.41x through the gateway",
    ),
    AutoDtypeRow(
        torch.float32,
        evidence=_SECTION + "'Sapphire Rapids: the dtype table, build by build': without native bfloat16 dot "
        "products (the baseline, avx2 and avx512 builds, or no kernels) bfloat16 is widened in software: "
        "0.94-1.01x float32 from GGUF blocks, 1.06-1.09x from dense weights",
    ),
)


def auto_dtype_row(facts: DtypeFacts) -> AutoDtypeRow:
    """The table's row for these facts: a pure function, the same answer on every call."""
    return next(row for row in AUTO_DTYPE_TABLE if row.matches(facts))


def this_cpu(numerics: ResolvedNumerics, weights: WeightsFormat) -> DtypeFacts:
    """The facts of this process's CPU build (EMBER_CPU_ISA's, else the best the CPU runs)."""
    return DtypeFacts(cpu_ops.build_in_use(), _AMX_FLAG in cpu_ops.cpu_flags(), numerics, weights)


def auto_cpu_dtype(numerics: ResolvedNumerics, weights: WeightsFormat) -> torch.dtype:
    """The dtype `auto` loads a model in on this CPU, logged with the row that chose it."""
    facts = this_cpu(numerics, weights)
    row = auto_dtype_row(facts)
    logger.info(
        "dtype auto: %s for the %s build, %s numerics, %s weights (%s)",
        str(row.dtype).removeprefix("torch."), facts.build, facts.numerics, facts.weights, row.evidence,
    )
    return row.dtype


def requested_dtype(dtype: str | torch.dtype | None, device: torch.device) -> DtypeChoice:
    """`--dtype` as the loaders take it: a dtype, or "auto" on a CPU (decided by the table once the
    model's numerics and weights are known)."""
    if dtype in (None, "auto") and device.type == "cpu":
        return "auto"
    return resolve_dtype(dtype, device)


def resolved_dtype(dtype: DtypeChoice, numerics: ResolvedNumerics, weights: WeightsFormat) -> torch.dtype:
    return auto_cpu_dtype(numerics, weights) if dtype == "auto" else dtype
