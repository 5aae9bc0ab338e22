"""The llama.cpp comparison script without llama.cpp: its arguments, llama-server's context size,
the rounds' order, the reuse of a build and of expanded files, and the table from given numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_bench.llama_cpp_check import CHECK_SERVER_ARGS
from ember_bench.llama_cpp_compare import (
    EMBER,
    LLAMA,
    CompareConfig,
    CompareRun,
    compare_table,
    cpu_name,
    expand_gguf,
    header,
    llama_server_files,
    parse_args,
    server_order,
    throughput_ratio,
)
from ember_bench.llama_server import LLAMA_CPP_PYTHON_VERSION, LlamaServer, build_llama_cpp
from ember_bench.stats import Distribution, ServeMetrics

MISSING = Path("/nonexistent/llama-quantize")  # running it would fail the test


def metrics(tok_s: float, ttft_ms: float = 1500.0, tpot_ms: float = 80.0, completed: int = 32) -> ServeMetrics:
    return ServeMetrics(
        completed=completed, failed=32 - completed, duration_s=10.0, input_tokens=0, output_tokens=int(tok_s * 10),
        request_throughput=completed / 10, output_throughput=tok_s, total_token_throughput=tok_s,
        ttft_ms=Distribution(ttft_ms, ttft_ms, ttft_ms), tpot_ms=Distribution(tpot_ms, tpot_ms, tpot_ms),
        itl_ms=None, e2e_ms=None, goodput=None, errors=[],
    )


def test_defaults_and_the_binaries_or_a_build_dir() -> None:
    args = parse_args(["--llama-cpp-dir", "build"])
    assert args.dtypes == ("float32", "bfloat16")
    assert (args.rounds, args.num_prompts, args.input_len, args.output_len, args.concurrency) == (2, 32, 200, 150, 16)
    assert args.model is None and args.llama_server is None
    binaries = parse_args(["--llama-server", "s", "--llama-quantize", "q", "--dtypes", "bfloat16", "--threads", "4"])
    assert binaries.llama_cpp_dir is None and binaries.dtypes == ("bfloat16",) and binaries.threads == 4


def test_a_stored_file_needs_no_llama_quantize_and_is_served_as_it_is(tmp_path: Path) -> None:
    defaults = parse_args(["--llama-cpp-dir", "d"])
    assert (defaults.llama_weights, defaults.numerics) == ("stored", "auto")  # as each tool's users run the file
    args = parse_args(["--llama-server", "s"])
    assert args.llama_quantize is None and args.llama_weights == "stored"
    config = CompareConfig(model=Path("moe.gguf"), threads=2)
    assert llama_server_files(config, None, tmp_path) == {"float32": Path("moe.gguf"), "bfloat16": Path("moe.gguf")}
    assert "on the file as stored" in header(config, "version: 1") and "--numerics auto" in header(config, "version: 1")
    exact = parse_args(["--llama-server", "s", "--llama-quantize", "q", "--numerics", "exact", "--llama-weights", "expanded"])
    assert (exact.numerics, exact.llama_weights) == ("exact", "expanded")


@pytest.mark.parametrize("argv", [
    [],
    ["--llama-server", "s", "--llama-weights", "expanded"],  # expanding needs llama-quantize
    ["--llama-server", "s", "--llama-weights", "original"],
    ["--llama-server", "s", "--numerics", "int4"],
    ["--llama-cpp-dir", "d", "--dtypes", "float16"],
    ["--llama-cpp-dir", "d", "--rounds", "0"],
])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2


def test_llama_server_gets_a_slot_per_stream_with_room_for_prompt_and_output() -> None:
    config = CompareConfig(model=Path("m.gguf"), concurrency=16, input_len=200, output_len=150, threads=2)
    assert config.llama_context == 16 * (200 + 150 + 64)
    assert config.llama_server_args == ("-np", "16", "-c", "6624", "-t", "2")
    assert config.requests() == config.requests()  # the same prompts for both servers
    assert len(config.requests()) == 32 and config.requests()[0].max_tokens == 150


def test_the_server_args_are_passed_through() -> None:
    server = LlamaServer(Path("llama-server"), Path("m.gguf"), Path("log"), CHECK_SERVER_ARGS)
    assert server.command[-7:] == ["-c", "512", "-np", "1", "-t", "2", "--no-warmup"]
    assert server.url == f"http://127.0.0.1:{server.port}"


def test_rounds_alternate_which_server_runs_first() -> None:
    assert [server_order(n) for n in (1, 2, 3)] == [(EMBER, LLAMA), (LLAMA, EMBER), (EMBER, LLAMA)]


def test_a_build_holding_both_binaries_is_reused(tmp_path: Path) -> None:
    bin_dir = tmp_path / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-server", "llama-quantize"):
        (bin_dir / name).touch()
    assert build_llama_cpp(tmp_path) == bin_dir


def test_an_expanded_file_is_reused(tmp_path: Path) -> None:
    expanded = tmp_path / "model.Q4_1.BF16.gguf"
    expanded.touch()
    assert expand_gguf(MISSING, Path("elsewhere/model.Q4_1.gguf"), "BF16", tmp_path) == expanded


def test_table_has_every_round_and_ember_over_llama_server() -> None:
    runs = [
        CompareRun(1, "float32", EMBER, metrics(40.0)), CompareRun(1, "float32", LLAMA, metrics(50.0)),
        CompareRun(2, "float32", LLAMA, metrics(40.0, completed=31)), CompareRun(2, "float32", EMBER, metrics(60.0)),
        CompareRun(1, "bfloat16", EMBER, metrics(90.0, ttft_ms=800.0, tpot_ms=45.5)),
    ]
    assert throughput_ratio(runs, "float32", 1) == pytest.approx(0.8)
    assert throughput_ratio(runs, "float32", 2) == pytest.approx(1.5)
    assert throughput_ratio(runs, "bfloat16", 1) is None  # llama-server has not run yet
    assert compare_table(runs).splitlines()[2:] == [
        "| float32 | ember | 40.0 / 60.0 | 0.80 / 1.50 | 1.50 / 1.50 | 80.0 / 80.0 | 32 / 32 | 0 / 0 |",
        "| float32 | llama-server | 50.0 / 40.0 | 1.00 / 1.00 | 1.50 / 1.50 | 80.0 / 80.0 | 32 / 31 | 0 / 1 |",
        "| bfloat16 | ember | 90.0 | n/a | 0.80 | 45.5 | 32 | 0 |",
    ]


def test_cpu_name_comes_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n")
    assert cpu_name(cpuinfo) == "AMD EPYC 9R14 96-Core Processor"
