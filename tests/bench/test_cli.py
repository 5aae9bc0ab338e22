"""The CLI contract: bad inputs are one line on stderr and exit code 2; `bench` plugs into `ember`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ember_bench.cli import add_bench_parser
from tests.bench.helpers import run_bench_cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--workload", "/no/such/workload.json"], "cannot read workload /no/such/workload.json"),
        (["serve", "--random-prompts", "2", "--goodput", "ttft:fast"], "bad --goodput spec 'ttft:fast'"),
        (["serve", "--random-prompts", "0"], "--random-prompts must be >= 1"),
        (["serve", "--random-prompts", "2", "--concurrency", "0"], "--concurrency must be >= 1"),
        (["offline", "--random-prompts", "2", "--compare", "batching,speed"], "unknown --compare key 'speed'"),
        (["offline", "--random-prompts", "2", "--concurrency", "1,x"], "--concurrency must be comma-separated"),
        (["offline", "--random-prompts", "2", "--concurrency", "0"], "--concurrency needs integers >= 1"),
    ],
)
def test_bad_inputs_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert run_bench_cli(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ember bench: error: ") and message in err and "\n" not in err


def test_a_bad_workload_file_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    workload = tmp_path / "bad.json"
    workload.write_text('[{"prompt": "x"}]')
    assert run_bench_cli("serve", "--workload", str(workload)) == 2
    err = capsys.readouterr().err.strip()
    assert "item 0: 'max_tokens' must be an integer >= 1" in err and "\n" not in err


def test_add_bench_parser_registers_both_commands() -> None:
    parser = argparse.ArgumentParser(prog="ember")
    add_bench_parser(parser.add_subparsers(dest="command"))
    serve = parser.parse_args(["bench", "serve", "--random-prompts", "4", "--request-rate", "2.5"])
    offline = parser.parse_args(["bench", "offline", "--workload", "w.json", "--compare", "dtype"])
    assert (serve.command, serve.bench_command, serve.request_rate) == ("bench", "serve", 2.5)
    assert (offline.bench_command, offline.compare, offline.concurrency) == ("offline", "dtype", "1,4,16")
    assert callable(serve.bench_handler) and callable(offline.bench_handler)
