"""`ember bench abuse` on the test model, every attack small and every timeout short."""

from __future__ import annotations

import json
from pathlib import Path

from ember_bench.cli import main as bench_main
from tests.gateway.tiny_tokenizer import write_model_with_tokenizer


def test_the_abuse_bench_reports_each_attack_closed_and_nothing_lost(gpt2_dir: Path, tmp_path: Path, capsys) -> None:
    model = write_model_with_tokenizer(gpt2_dir, tmp_path / "model")
    output = tmp_path / "abuse.json"
    serve_args = "--dtype float32 --header-timeout 1 --body-timeout 1 --keepalive-timeout 1"
    code = None
    try:
        bench_main(["abuse", "--model", str(model), "--slow-connections", "20", "--idle-connections", "10",
                    "--slow-bodies", "10", "--storm-requests", "10", "--soak", "3", "--soak-concurrency", "2", "--rounds", "1",
                    "--serve-args", serve_args, "--output-json", str(output)])
    except SystemExit as exc:
        code = exc.code
    assert code is None, capsys.readouterr()
    report = json.loads(output.read_text())
    (round_,) = report["rounds"]
    phases = round_["phases"]
    for attack, count in (("slowloris", 20), ("idle", 10)):
        assert phases[attack]["closed_by_server"] == count and phases[attack]["closed_after_s_max"] < 10
    assert phases["slow_bodies"]["answered"] == {"408": 5, "413": 5}
    assert phases["disconnect_storm"]["running_at_end"] == 0
    assert phases["soak"]["lost"] == 0 and phases["soak"]["ok"] > 0
    assert len(round_["processes_end"]) == 3  # the launcher, its engine and its gateway
    assert "slowloris" in capsys.readouterr().out
