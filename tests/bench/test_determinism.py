"""`ember bench determinism` on the packaged SmolLM2 file: every request gives one output over
replays in random mixes, on a quiet machine and with busy processes competing for its cores, and
the count tells outputs apart by one bit of one logprob."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember_bench.cli import main as bench_main
from ember_bench.determinism import _fingerprint
from ember_core.kernels import cpu_ops
from ember_proto import TokenLogprob

SETTINGS = ["--dtype", "float32", "--numerics", "fast"]  # what the default model runs by default, named


def _replay_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str], settings: list[str]) -> None:
    output = tmp_path / "determinism.json"
    bench_main(["determinism", "--prompts", "2", "--replays", "4", "--max-tokens", "4", *settings, "--output-json", str(output)])
    report = json.loads(output.read_text())
    outcomes = report["report"]["outcomes"]
    assert [outcome["name"] for outcome in outcomes] == ["0-short-greedy", "0-short-seeded", "1-long-greedy", "1-long-seeded"]
    assert report["deterministic"] and all(outcome["distinct_outputs"] == 1 for outcome in outcomes)
    assert len(set(report["report"]["engine_settings"])) == 1  # the three engines resolved one configuration
    assert all(outcome["runs"] >= 2 for outcome in outcomes)  # alone, and in the mixed replays
    assert report["report"]["output_tokens"] == 4 * sum(outcome["runs"] for outcome in outcomes)
    assert "every request gave one output" in capsys.readouterr().out


@pytest.mark.skipif(not cpu_ops.is_available(), reason="the default model's fast numerics run on ember's C++ CPU ops")
def test_every_request_gives_one_output_over_the_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _replay_and_check(tmp_path, capsys, SETTINGS)


@pytest.mark.skipif(not cpu_ops.is_available(), reason="the default model's fast numerics run on ember's C++ CPU ops")
def test_the_replays_agree_with_busy_processes_on_every_core(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With `--dtype auto` in exact numerics (bfloat16 on an AMX or Zen 4 build, float32 below): the
    bench's three engines start while busy loops hold every core, and decide what they compute by
    rule, not by how fast they ran then (a start-up stopwatch once gave them different dtypes on a
    loaded machine)."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(os.cpu_count() or 2)
    ]
    try:
        _replay_and_check(tmp_path, capsys, ["--dtype", "auto", "--numerics", "exact"])
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_outputs_one_bit_apart_count_as_two() -> None:
    def output(chosen: float, runner_up: float) -> tuple:
        return _fingerprint([5, 6], [TokenLogprob(5, -0.1, [(5, -0.1)]), TokenLogprob(6, chosen, [(6, chosen), (7, runner_up)])])

    first, same = output(-0.7421, -2.0), output(-0.7421, -2.0)
    chosen_nudged = output(math.nextafter(-0.7421, 0.0), -2.0)
    top_nudged = output(-0.7421, math.nextafter(-2.0, 0.0))
    assert len({first, same}) == 1
    assert len({first, top_nudged, chosen_nudged}) == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--prompts", "0"], "--prompts must be between 1 and 32"), (["--replays", "1"], "--replays must be at least 2")],
)
def test_bad_settings_are_one_line_and_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["determinism", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
