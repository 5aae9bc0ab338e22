"""`--dtype auto` on a CPU is a rule: a pure function of the build, the CPU's AMX, the numerics and
the weights' format, over a table whose every row cites figures that docs/benchmarks.md holds; a
model loads in the same dtype however often it starts; no clock decides what the engine computes."""

from __future__ import annotations

import itertools
import logging
import re
from pathlib import Path

import pytest
import torch

from ember_core.auto_dtype import AUTO_DTYPE_TABLE, DtypeFacts, auto_dtype_row, requested_dtype, this_cpu
from ember_core.config import DEFAULT_MODEL
from ember_core.kernels import cpu_ops
from ember_core.loaders import load_model

ROOT = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")
BUILDS = ("baseline", "avx2", "avx512", "avx512bf16", "amx", cpu_ops.NO_KERNELS)  # every build, any machine
F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    ("build", "cpu_has_amx", "numerics", "expected"),
    [
        ("amx", True, "exact", BF16),  # AMX-BF16 tiles
        ("amx", True, "fast", F32),  # int8 either way: float32 keeps fast closest to exact
        ("avx512bf16", False, "exact", BF16),  # Zen 4 and 5: vdpbf16ps beats float32 FMAs
        ("avx512bf16", True, "exact", F32),  # an AMX CPU made to run its lower build: it does not
        ("avx512bf16", False, "fast", F32),
        ("avx512", False, "exact", F32),  # bfloat16 widened in software
        ("avx512", True, "exact", F32),
        ("avx2", False, "exact", F32),
        ("baseline", False, "exact", F32),
        (cpu_ops.NO_KERNELS, True, "exact", F32),
    ],
)
def test_the_table_picks_by_build_cpu_and_numerics(build: str, cpu_has_amx: bool, numerics, expected: torch.dtype) -> None:
    for weights in ("gguf-blocks", "dense"):
        assert auto_dtype_row(DtypeFacts(build, cpu_has_amx, numerics, weights)).dtype is expected


def test_every_fact_has_one_answer_and_every_row_is_reachable() -> None:
    facts = [DtypeFacts(*combination) for combination in itertools.product(BUILDS, (False, True), ("exact", "fast"), ("gguf-blocks", "dense"))]
    rows = [auto_dtype_row(fact) for fact in facts]
    assert rows == [auto_dtype_row(fact) for fact in facts]  # a pure function: the same answer every call
    assert {id(row) for row in rows} == {id(row) for row in AUTO_DTYPE_TABLE}


def test_every_row_cites_a_section_of_the_benchmarks_that_exists() -> None:
    headings = [line.removeprefix("### ") for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines() if line.startswith("### ")]
    for row in AUTO_DTYPE_TABLE:
        cited = re.match(r"docs/benchmarks\.md, '([^']+)'", row.evidence)
        assert cited is not None, row.evidence
        assert any(heading.startswith(cited.group(1)) for heading in headings), cited.group(1)


def test_explicit_dtypes_are_kept_and_auto_waits_for_the_model_on_a_cpu() -> None:
    assert requested_dtype("float32", CPU) is F32
    assert requested_dtype("bf16", CPU) is BF16
    assert requested_dtype(None, CPU) == requested_dtype("auto", CPU) == "auto"


def test_the_default_model_loads_in_the_tables_dtype_every_time(caplog: pytest.LogCaptureFixture) -> None:
    """The packaged Q4_1 file: fast numerics by default (float32 on every build), and exact, whose
    dtype follows this CPU's build; each loaded twice, logged with the row that chose it."""
    for numerics in ("auto", "exact"):
        with caplog.at_level(logging.INFO, logger="ember_core.auto_dtype"):
            first, second = (load_model(DEFAULT_MODEL, CPU, "auto", numerics=numerics) for _ in range(2))
        runs_blocks = cpu_ops.is_available()
        expected = auto_dtype_row(this_cpu(first.numerics, "gguf-blocks" if runs_blocks else "dense")).dtype
        assert first.dtype is second.dtype is expected
        assert first.cpu_build == cpu_ops.build_in_use()
        lines = [record.getMessage() for record in caplog.records if record.name == "ember_core.auto_dtype"]
        assert len(lines) == 2 and lines[0] == lines[1]
        assert lines[0].startswith(f"dtype auto: {str(expected).removeprefix('torch.')} for the {first.cpu_build} build")
        caplog.clear()


# Where ember_core reads a clock, and why none of them changes what it computes.
CLOCKS_ALLOWED = {
    "engine/engine.py": "a request's arrival time, and each step's duration for the dashboard",
    "engine/scheduler.py": "priority aging orders the queue; a row's bits do not depend on its batch",
    "kernels/cpu_ops.py": "how long the kernels took to compile, logged",
    "parallel/shared_exchange.py": "how often a waiting rank checks that its peers live",
}


def test_no_clock_decides_what_the_engine_computes() -> None:
    """A stopwatch once chose the dtype at start-up; a new clock read in ember_core must be listed
    above with the reason it changes no output."""
    core = ROOT / "ember_core"
    reading = {
        str(path.relative_to(core))
        for path in core.rglob("*.py")
        if re.search(r"\b(perf_counter|monotonic|process_time|time\.time)\(", path.read_text())
    }
    assert reading == set(CLOCKS_ALLOWED)
