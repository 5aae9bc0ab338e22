"""The C++ ops' builds per instruction set: which one runs (EMBER_CPU_ISA or the best the CPU
has), what an impossible choice says, and that the builds from AVX2 up give the same float32 bits,
whatever tuning or contraction a compiler would choose (the flags are fixed, FMAs explicit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember_core import LLM, SamplingParams
from ember_core.kernels import cpu_ops
from tests.conftest import token_prompts

ISA_VARIABLE = cpu_ops.ISA_ENVIRONMENT_VARIABLE


def _active_in_a_process(isa: str | None) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != ISA_VARIABLE}
    if isa is not None:
        environment[ISA_VARIABLE] = isa
    code = "from ember_core.kernels import cpu_ops; print(cpu_ops.active_instruction_set().name, cpu_ops.is_available())"
    return subprocess.run([sys.executable, "-c", code], env=environment, check=False, capture_output=True, text=True,
                          timeout=300)


def test_the_best_runnable_build_is_the_default_and_the_variable_picks_another() -> None:
    runnable = [isa.name for isa in cpu_ops.runnable_instruction_sets()]
    assert runnable[0] == "baseline"
    assert _active_in_a_process(None).stdout.split() == [runnable[-1], "True"]
    for name in runnable:
        assert _active_in_a_process(name.upper()).stdout.split() == [name, "True"]


def test_an_unknown_or_unrunnable_instruction_set_is_refused_by_name() -> None:
    unknown = _active_in_a_process("sse9")
    assert unknown.returncode != 0
    assert f"{ISA_VARIABLE}='sse9': expected one of {', '.join(isa.name for isa in cpu_ops.INSTRUCTION_SETS)}" in unknown.stderr
    unrunnable = [isa for isa in cpu_ops.INSTRUCTION_SETS if isa.missing_cpu_flags()]
    if not unrunnable:
        pytest.skip("this CPU runs every instruction set ember builds")
    refused = _active_in_a_process(unrunnable[0].name)
    assert f"this CPU lacks {', '.join(unrunnable[0].missing_cpu_flags())}" in refused.stderr


@pytest.fixture(scope="module")
def vector_builds() -> list[cpu_ops.InstructionSet]:
    """Every build from AVX2 up that this CPU runs (avx512bf16 and amx differ from avx512 in their
    bfloat16 linear, and amx in its int8 linear's AMX tiles, whose bits must be the VNNI path's)."""
    x86 = [isa for isa in cpu_ops.INSTRUCTION_SETS if isa.name != "baseline"]
    wanted = [isa for isa in x86 if not isa.missing_cpu_flags()]
    if len(wanted) < 2:
        missing = sorted({flag for isa in x86 for flag in isa.missing_cpu_flags()} - {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})
        pytest.skip(f"comparing the AVX2 and AVX-512 builds needs an x86-64 CPU with {', '.join(missing) or 'both'}")
    for isa in wanted:
        cpu_ops.use_instruction_set(isa)
        assert cpu_ops.is_available(), cpu_ops.unavailable_reason()
    cpu_ops.use_instruction_set(None)
    return wanted


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_every_vector_build_serves_the_same_float32_bits(vector_builds, smollm2_gguf_path: Path, numerics: str) -> None:
    """The real model from its Q4_1 blocks, prompts of several lengths batched together: every
    linear (widened blocks, or int8 dot products), norm, rotary, attention and fused layer of both
    builds, prefill and decode. Only the ops differ between the runs (torch's own are the same in
    one process)."""
    llm = LLM(str(smollm2_gguf_path), block_size=16, num_blocks=128, dtype="float32", device="cpu", numerics=numerics)
    prompts = token_prompts(6, vocab_size=49152, min_len=5, max_len=60)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    runs = []
    try:
        for isa in vector_builds:
            cpu_ops.use_instruction_set(isa)
            llm.reset_prefix_cache()
            runs.append([(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(prompts, params)])
    finally:
        cpu_ops.use_instruction_set(None)
    assert all(run == runs[0] for run in runs[1:])
