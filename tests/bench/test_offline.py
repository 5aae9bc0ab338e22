"""`bench offline` on a tiny random GPT-2 (token-id prompts: it has no tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ember_bench.offline_runs import EngineSetting, OfflineRun, settings_to_compare
from ember_bench.report import median_runs
from ember_bench.stats import Distribution
from tests.bench.helpers import read_json, run_bench_cli
from tests.gateway.tiny_tokenizer import write_model_with_tokenizer

TINY_RUN = ("--random-prompts", "3", "--random-input-len", "5", "--random-output-len", "4",
            "--device", "cpu", "--block-size", "4", "--num-blocks", "64")


def test_two_settings_two_concurrencies_and_the_transformers_baseline(gpt2_dir: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "offline.json", tmp_path / "offline.png"
    code = run_bench_cli("offline", "--model", str(gpt2_dir), *TINY_RUN, "--compare", "batching",
                         "--concurrency", "1,2", "--transformers", "--output-json", str(out), "--plot", str(png))
    assert code == 0
    result = read_json(out)
    runs = result["runs"]
    assert [(run["name"], run["concurrency"]) for run in runs] == [
        ("ember continuous/preempt/float32", 1), ("ember continuous/preempt/float32", 2),
        ("ember static/preempt/float32", 1), ("ember static/preempt/float32", 2),
        ("transformers static/float32", 1), ("transformers static/float32", 2),
    ]
    for run in runs:
        assert run["num_requests"] == 3 and run["output_tokens"] == 3 * 4
        assert run["output_throughput"] > 0 and run["request_throughput"] > 0 and run["duration_s"] > 0
        latency = run["latency_ms"]
        assert 0 < latency["median"] <= latency["p99"] <= run["duration_s"] * 1e3
    assert result["environment"]["torch_num_threads"] >= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_prompts_need_a_tokenizer(gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    workload = tmp_path / "workload.json"
    workload.write_text('[{"prompt": "hello there", "max_tokens": 2}]')
    code = run_bench_cli("offline", "--model", str(gpt2_dir), "--workload", str(workload), "--device", "cpu",
                         "--compare", "", "--concurrency", "1")
    assert code == 2
    assert "no tokenizer files" in capsys.readouterr().err


def test_each_compared_axis_is_switched_alone() -> None:
    baseline = EngineSetting("continuous", "preempt", "float32")
    assert settings_to_compare(baseline, ["dtype", "batching", "dtype"]) == [
        baseline, EngineSetting("continuous", "preempt", "bfloat16"), EngineSetting("static", "preempt", "float32"),
    ]
    switched = settings_to_compare(EngineSetting("static", "reserve", "bfloat16"), ["batching", "admission", "dtype"])
    assert switched[1:] == [
        EngineSetting("continuous", "reserve", "bfloat16"),
        EngineSetting("static", "preempt", "bfloat16"),
        EngineSetting("static", "reserve", "float32"),
    ]
    with pytest.raises(ValueError, match="unknown --compare key 'speed'"):
        settings_to_compare(baseline, ["speed"])


def test_prefix_caching_axis_runs_shared_prefixes_with_and_without_the_cache(gpt2_dir: Path, tmp_path: Path) -> None:
    workload, out = tmp_path / "shared.json", tmp_path / "offline.json"
    shared = list(range(1, 41))
    workload.write_text(json.dumps([{"prompt": shared + [100 + i], "max_tokens": 3} for i in range(4)]))
    code = run_bench_cli("offline", "--model", str(gpt2_dir), "--workload", str(workload), "--device", "cpu",
                         "--block-size", "16", "--compare", "prefix_caching", "--concurrency", "1", "--output-json", str(out))
    assert code == 0
    runs = read_json(out)["runs"]
    assert [run["name"] for run in runs] == [
        "ember continuous/preempt/float32", "ember continuous/preempt/float32/no-prefix-cache",
    ]
    # One at a time: the first computes the 40 shared tokens, the other three find 32 of them.
    assert [run["prefix_cache_hits"] for run in runs] == [3 * 32, 0]
    assert [run["output_tokens"] for run in runs] == [4 * 3, 4 * 3]


def test_rounds_interleave_the_settings_and_the_table_ends_with_each_median_round(
    gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
) -> None:
    out = tmp_path / "offline.json"
    code = run_bench_cli("offline", "--model", str(gpt2_dir), *TINY_RUN, "--compare", "batching",
                         "--concurrency", "2", "--rounds", "3", "--output-json", str(out))
    assert code == 0
    runs = read_json(out)["runs"]
    continuous, static = "ember continuous/preempt/float32", "ember static/preempt/float32"
    assert [(run["round"], run["name"]) for run in runs] == [
        (1, continuous), (1, static), (2, continuous), (2, static), (3, continuous), (3, static),
    ]
    table = capsys.readouterr().out
    medians = table.split("the median round of each configuration (by tok/s):")[1].splitlines()[3:5]
    for name, median_line in zip((continuous, static), medians):
        speeds = sorted(run["output_throughput"] for run in runs if run["name"] == name)
        assert median_line.startswith(name) and f"{speeds[1]:.1f}" in median_line.split()


def test_the_median_round_is_a_run_that_happened() -> None:
    def run(name: str, round_number: int, tokens_per_s: float) -> OfflineRun:
        latency = Distribution.of([1.0], 1e3)
        assert latency is not None
        return OfflineRun("ember", EngineSetting(batching=name), 4, 1, 10, 10 / tokens_per_s, tokens_per_s,
                          1.0, latency, 0, round=round_number)

    runs = [run("continuous", 1, 90.0), run("static", 1, 50.0), run("continuous", 2, 70.0),
            run("static", 2, 40.0), run("continuous", 3, 80.0), run("continuous", 4, 100.0)]
    assert [(r.setting.batching, r.round) for r in median_runs(runs)] == [("continuous", 3), ("static", 2)]


def test_rounds_must_be_positive(gpt2_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code = run_bench_cli("offline", "--model", str(gpt2_dir), *TINY_RUN, "--compare", "", "--rounds", "0")
    assert code == 2
    assert "--rounds needs an integer >= 1, got 0" in capsys.readouterr().err


def test_structured_outputs_axis_constrains_every_request_and_keeps_their_lengths(gpt2_dir: Path, tmp_path: Path) -> None:
    model = write_model_with_tokenizer(gpt2_dir, tmp_path / "model")
    out = tmp_path / "offline.json"
    code = run_bench_cli("offline", "--model", str(model), *TINY_RUN, "--compare", "structured_outputs",
                         "--concurrency", "3", "--output-json", str(out))
    assert code == 0
    runs = read_json(out)["runs"]
    assert [run["name"] for run in runs] == [
        "ember continuous/preempt/float32", "ember continuous/preempt/float32/json-schema",
    ]
    assert [run["output_tokens"] for run in runs] == [3 * 4, 3 * 4]  # the constraint runs to max_tokens


@pytest.mark.parametrize("bfloat16_tok_s", [100.0, 119.0, 121.0, 200.0])
def test_a_dtype_comparison_is_set_beside_the_auto_tables_pick(bfloat16_tok_s: float) -> None:
    """A ratio on the far side of the gain a row needs (1.2x) from what the table picks on this
    machine is flagged; on the same side it is not."""
    from ember_bench.dtype_rows import dtype_verdicts
    from ember_core.auto_dtype import auto_dtype_row, this_cpu

    def run(dtype: str, tok_s: float) -> OfflineRun:
        latency = Distribution.of([1.0], 1e3)
        assert latency is not None
        return OfflineRun("ember", EngineSetting(dtype=dtype), 16, 1, int(tok_s), 1.0, tok_s, 1.0, latency, 0)

    picks_bfloat16 = auto_dtype_row(this_cpu("exact", "gguf-blocks")).dtype is torch.bfloat16
    (line,) = dtype_verdicts([run("float32", 100.0), run("bfloat16", bfloat16_tok_s)])
    assert line.startswith(f"dtype auto: bfloat16 / float32 = {bfloat16_tok_s / 100:.2f}x at 16 sequences (exact numerics")
    assert f"the table picks {'bfloat16' if picks_bfloat16 else 'float32'}" in line
    assert ("DISAGREES" in line) == ((bfloat16_tok_s >= 120.0) != picks_bfloat16)
