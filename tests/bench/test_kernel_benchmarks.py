"""The kernel benchmarks (python -m ember_bench.kernel_linear / kernel_attention) run."""

from __future__ import annotations

import json

import pytest
import torch

from ember_bench import kernel_linear
from ember_bench.cli import main as bench_main
from ember_bench.kernels import REFERENCE_KERNEL
from ember_core.kernels import cpu_ops


@pytest.mark.usefixtures("kernel")
def test_the_linear_kernel_benchmark_times_every_candidate(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["kernel_linear", "--batches", "2", "--repeats", "1"])
    kernel_linear.main()
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("batch    2")
    for name in kernel_linear.candidates():
        assert f"{name}:" in row


def test_the_kernel_table_reports_every_kernel_against_this_machine_s_peak(tmp_path, capsys) -> None:
    """On the best build this CPU runs (the lower ones' ops are the kernel tests' and the peak loop's)."""
    if not cpu_ops.is_available():
        pytest.skip(f"no C++ CPU ops here: {cpu_ops.unavailable_reason()}")
    output = tmp_path / "kernels.json"
    bench_main(["kernels", "--formats", "BF16,Q4_1", "--rows", "1,4", "--batches", "2", "--context", "32",
                "--repeats", "1", "--layers", "1", "--output-json", str(output)])
    report = json.loads(output.read_text())
    assert report["peak"]["fma_gflops"] > 0 and report["peak"]["read_gbps"] > 0 and report["peak"]["int8_dot_gops"] > 0
    has_bf16_dot = cpu_ops.active_instruction_set().name in ("avx512bf16", "amx")
    assert (report["peak"]["bf16_dot_gflops"] is not None) == has_bf16_dot
    timed = {(t["kernel"], t["dtype"], t["rows"]) for t in report["timings"]}
    for kernel_name in ("layer linears Q4_1", "head Q8_0", "layer linears Q4_1, int8", "head Q8_0, int8"):
        # blocks run in either dtype and numerics, dense weights in their own
        assert {(kernel_name, dtype, rows) for dtype in ("float32", "bfloat16") for rows in (1, 4)} <= timed
    assert {("layer linears BF16", "bfloat16", 1), ("layer linears BF16", "bfloat16", 4)} <= timed
    assert not any(kernel == "layer linears BF16" and dtype == "float32" for kernel, dtype, _ in timed)
    assert {(REFERENCE_KERNEL, "bfloat16", 1), (REFERENCE_KERNEL, "bfloat16", 4)} <= timed  # torch's GEMM, the bar
    for query, cache in (("float32", "float32"), ("float32", "bfloat16"), ("float32", "int8"), ("float32", "fp8_e4m3"),
                         ("bfloat16", "bfloat16"), ("bfloat16", "int8"), ("bfloat16", "fp8_e4m3")):
        assert (f"paged attention, {cache} K/V, context 32", query, 2) in timed
    for dtype in ("float32", "bfloat16"):
        assert ("its linears alone, per layer", dtype, 16) in timed
        assert ("decode layer, fused (SmolLM2 GGUF)", dtype, 16) in timed  # a decode step of the packaged model
    assert all(t["gflops"] > 0 and t["gbps"] > 0 for t in report["timings"])
    assert "% peak" in capsys.readouterr().out


@pytest.mark.usefixtures("kernel")
def test_the_peak_loop_counts_its_operations_and_names_a_missing_instruction() -> None:
    ops = cpu_ops.ops()
    lanes = 16 if cpu_ops.active_instruction_set().name in ("avx512", "avx512bf16", "amx") else 8
    assert ops.peak_loop("fma", 10) == torch.get_num_threads() * 10 * 12 * lanes * 2
    if cpu_ops.active_instruction_set().name in ("avx512bf16", "amx"):
        assert ops.peak_loop("bf16_dot", 10) == torch.get_num_threads() * 10 * 12 * 32 * 2
    else:
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            ops.peak_loop("bf16_dot", 10)
    if cpu_ops.active_instruction_set().name == "baseline":
        with pytest.raises(RuntimeError, match="AVX2"):
            ops.peak_loop("int8_dot", 10)
    else:
        int8_lanes = 64 if cpu_ops.active_instruction_set().name in ("avx512", "avx512bf16", "amx") else 32
        assert ops.peak_loop("int8_dot", 10) == torch.get_num_threads() * 10 * 12 * int8_lanes * 2
    with pytest.raises(RuntimeError, match="fma, bf16_dot or int8_dot"):
        ops.peak_loop("fp8", 10)


@pytest.mark.parametrize(("flag", "value"), [("--formats", "Q9_9"), ("--dtypes", "float8"), ("--rows", "one")])
def test_the_kernel_bench_refuses_bad_input_in_one_line(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["kernels", flag, value])
    assert exit_info.value.code != 0 and flag in capsys.readouterr().err
