"""`ember bench tp-costs`: two ranks time a sum through shared memory and through gloo, each sum's
result checked on every rank; with --model, the model's linears are timed per step; bad settings
are one line and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_bench.cli import main as bench_main
from ember_bench.linear_share import time_linears
from ember_bench.parallel_sums import PATHS, measure_sums


def test_two_ranks_time_both_paths_for_every_shape() -> None:
    timings = measure_sums(2, [(1, 8), (16, 8)], repeats=20)
    assert [(t.path, t.rows, t.hidden) for t in timings] == [(path, rows, 8) for path in PATHS for rows in (1, 16)]
    assert all(t.median_us > 0 for t in timings)


def test_the_command_prints_a_row_per_path_and_shape(capsys: pytest.CaptureFixture[str]) -> None:
    bench_main(["tp-costs", "--rows", "2", "--hidden", "4", "--repeats", "5"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["path", "rows", "hidden", "median", "us"]
    assert [line.rsplit(maxsplit=3)[0] for line in lines[1:]] == list(PATHS)


def test_a_model_s_linears_are_timed_per_step(gpt2_dir: Path) -> None:
    timings = time_linears(str(gpt2_dir), "float32", "exact", [1, 4], repeats=3)
    # 2 blocks of c_attn, attn_proj, c_fc and mlp_proj, and the head
    assert [(t.rows, t.linears) for t in timings] == [(1, 9), (4, 9)]
    assert all(t.total_ms > 0 for t in timings)


@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "1"], ["--rows", "0"], ["--rows", "x"]])
def test_bad_settings_are_one_line_and_exit_2(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["tp-costs", *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
