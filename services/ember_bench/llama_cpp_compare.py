"""ember against llama.cpp's llama-server on one GGUF file, on this CPU: the same streamed load (`ember
bench serve --random-prompts N --ignore-eos --concurrency C`, same prompts) on `ember serve --model
FILE --dtype D` and on llama-server, in alternated rounds. Builds llama.cpp when asked to:

    python -m ember_bench.llama_cpp_compare --llama-cpp-dir DIR [--dtypes float32,bfloat16] [--output-json PATH]

DIR keeps the llama-cpp-python sdist, its llama.cpp build (reused when there), the expanded GGUF
files and the server logs; with --llama-server PATH --llama-quantize PATH nothing is built.

By default both serve the file as its users run it: llama-server on its own quantized kernels, ember
with `--numerics auto` (fast on a quantized file: int8 activations times the blocks' integers, as
llama.cpp computes). `--numerics exact --llama-weights expanded` compares the other arithmetic:
ember expands the blocks to float32 or bfloat16 as it computes, and llama-server serves the file
expanded by `llama-quantize --allow-requantize FILE OUT F32` (or BF16), the same values stored in
the dtype ember computes in.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from ember_bench.llama_server import LlamaServer, build_llama_cpp
from ember_bench.local_server import local_server
from ember_bench.serve import ServeConfig, run_serve
from ember_bench.stats import Distribution, ServeMetrics
from ember_bench.workload import BenchRequest, RandomPrompts

EMBER = "ember"
LLAMA = "llama-server"
# ember's dtype -> the llama-quantize type whose file llama-server computes in that dtype
FILE_TYPES = {"float32": "F32", "bfloat16": "BF16"}
CONTEXT_SLACK = 64  # tokens a slot holds beyond prompt and output: words of several tokens, BOS


@dataclass(frozen=True)
class CompareConfig:
    model: Path
    threads: int  # llama-server's -t
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    rounds: int = 2
    num_prompts: int = 32
    input_len: int = 200
    output_len: int = 150
    concurrency: int = 16
    llama_weights: str = "stored"  # llama-server serves the file as it is, or "expanded" to the dtype
    numerics: str = "auto"  # ember serve --numerics

    @property
    def llama_context(self) -> int:
        """llama-server's -c: it splits the context among its -np slots."""
        return self.concurrency * (self.input_len + self.output_len + CONTEXT_SLACK)

    @property
    def llama_server_args(self) -> tuple[str, ...]:
        return ("-np", str(self.concurrency), "-c", str(self.llama_context), "-t", str(self.threads))

    def requests(self) -> list[BenchRequest]:
        return RandomPrompts(self.num_prompts, self.input_len, self.output_len).words()


@dataclass(frozen=True)
class LlamaCpp:
    server: Path
    quantize: Path | None  # needed to expand the file


@dataclass(frozen=True)
class CompareRun:
    round: int
    dtype: str
    server: str  # EMBER or LLAMA
    metrics: ServeMetrics


def server_order(round_number: int) -> tuple[str, str]:
    """Odd rounds start with ember, even ones with llama-server, so neither always runs on a fresher machine."""
    return (EMBER, LLAMA) if round_number % 2 else (LLAMA, EMBER)


def llama_server_files(config: CompareConfig, quantize: Path | None, work_dir: Path) -> dict[str, Path]:
    """dtype -> the file llama-server serves: the model expanded to that dtype, or the model itself."""
    if config.llama_weights == "stored":
        return {dtype: config.model for dtype in config.dtypes}
    return {dtype: expand_gguf(quantize, config.model, FILE_TYPES[dtype], work_dir) for dtype in config.dtypes}


def run_compare(config: CompareConfig, llama: LlamaCpp, work_dir: Path) -> Iterator[CompareRun]:
    expanded = llama_server_files(config, llama.quantize, work_dir)
    requests = config.requests()
    for round_number in range(1, config.rounds + 1):
        for dtype in config.dtypes:
            for server in server_order(round_number):
                with _running(server, dtype, config, llama.server, expanded[dtype], work_dir) as url:
                    serve = ServeConfig(base_url=url, concurrency=config.concurrency, ignore_eos=True)
                    yield CompareRun(round_number, dtype, server, asyncio.run(run_serve(serve, requests)).metrics)


def expand_gguf(quantize: Path, model: Path, file_type: str, work_dir: Path) -> Path:
    """model with every tensor stored as file_type, in work_dir; made once, then reused."""
    expanded = work_dir / f"{model.stem}.{file_type}.gguf"
    if expanded.is_file():
        return expanded
    partial = expanded.with_suffix(".partial")
    log_path = expanded.with_suffix(".log")
    with log_path.open("w") as log:
        done = subprocess.run([str(quantize), "--allow-requantize", str(model), str(partial), file_type],
                              check=False, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"llama-quantize exited with {done.returncode}; see {log_path}")
    partial.rename(expanded)
    return expanded


@contextmanager
def _running(server: str, dtype: str, config: CompareConfig, llama_server: Path, expanded: Path,
             work_dir: Path) -> Iterator[str]:
    """The started server's URL."""
    if server == EMBER:
        with local_server(str(config.model), 1, ["--dtype", dtype, "--numerics", config.numerics]) as (url, _):
            yield url
    else:
        log_path = work_dir / f"llama-server-{dtype}.log"
        with LlamaServer(llama_server, expanded, log_path, config.llama_server_args) as running:
            yield running.url


def throughput_ratio(runs: list[CompareRun], dtype: str, round_number: int) -> float | None:
    """ember's output tok/s over llama-server's, in one round and dtype; None without both."""
    tok_s = {run.server: run.metrics.output_throughput for run in runs if (run.dtype, run.round) == (dtype, round_number)}
    if EMBER not in tok_s or not tok_s.get(LLAMA):
        return None
    return tok_s[EMBER] / tok_s[LLAMA]


def compare_table(runs: list[CompareRun]) -> str:
    """A markdown table, a row per dtype and server, each cell its rounds' values as 'round 1 / round 2 / ...'."""
    lines = ["| dtype | server | output tok/s | x llama-server | TTFT p50 (s) | TPOT p50 (ms) | completed | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype in dict.fromkeys(run.dtype for run in runs):
        for server in (EMBER, LLAMA):
            rows = sorted((run for run in runs if (run.dtype, run.server) == (dtype, server)), key=lambda run: run.round)
            if rows:
                lines.append(_table_row(runs, dtype, server, rows))
    return "\n".join(lines)


def _table_row(runs: list[CompareRun], dtype: str, server: str, rows: list[CompareRun]) -> str:
    ratios = [throughput_ratio(runs, dtype, row.round) for row in rows] if server == EMBER else [1.0] * len(rows)
    cells = [
        [f"{row.metrics.output_throughput:.1f}" for row in rows],
        ["n/a" if ratio is None else f"{ratio:.2f}" for ratio in ratios],
        [_median(row.metrics.ttft_ms, 1e-3, ".2f") for row in rows],
        [_median(row.metrics.tpot_ms, 1.0, ".1f") for row in rows],
        [str(row.metrics.completed) for row in rows],
        [str(row.metrics.failed) for row in rows],
    ]
    return f"| {dtype} | {server} | " + " | ".join(" / ".join(cell) for cell in cells) + " |"


def _median(distribution: Distribution | None, scale: float, spec: str) -> str:
    return "n/a" if distribution is None else format(distribution.median * scale, spec)


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, from /proc/cpuinfo or, where it names none (Arm), lscpu."""
    try:
        name = _field(cpuinfo.read_text(), "model name")
    except OSError:
        name = None
    if name is None:
        try:
            name = _field(subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout, "Model name")
        except OSError:
            name = None
    return name or "unknown CPU"


def _field(text: str, key: str) -> str | None:
    for line in text.splitlines():
        name, separator, value = line.partition(":")
        if separator and name.strip() == key:
            return value.strip()
    return None


def llama_cpp_version(llama_server: Path) -> str:
    """As `llama-server --version` says it, e.g. 'version: 0.5.0-dev (build 1, commit 0c1e570)'."""
    done = subprocess.run([str(llama_server), "--version"], check=False, capture_output=True, text=True,
                          timeout=60)
    return next((line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")), "unknown")


def header(config: CompareConfig, llama_version: str) -> str:
    return (
        f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs); model {config.model.name}\n"
        f"{config.num_prompts} prompts of {config.input_len} random words -> {config.output_len} tokens "
        f"(ignore_eos), concurrency {config.concurrency}; rounds: {config.rounds}, alternating which server runs first\n"
        f"ember serve --dtype D --numerics {config.numerics}  vs  llama-server {' '.join(config.llama_server_args)} "
        f"on the file {'expanded to D' if config.llama_weights == 'expanded' else 'as stored'} (llama.cpp {llama_version})"
    )


def _default_model() -> Path:
    from ember_core.config import DEFAULT_MODEL
    from ember_core.loaders.resolve import resolve_model

    return resolve_model(DEFAULT_MODEL)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _dtypes(text: str) -> tuple[str, ...]:
    dtypes = tuple(name.strip() for name in text.split(",") if name.strip())
    if not dtypes or any(dtype not in FILE_TYPES for dtype in dtypes):
        raise argparse.ArgumentTypeError(f"must be comma-separated {' or '.join(FILE_TYPES)}, got {text!r}")
    return dtypes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ember_bench.llama_cpp_compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp-dir", type=Path, metavar="DIR",
                        help="build llama.cpp here (or reuse the build), keep expanded GGUF files and logs here")
    parser.add_argument("--llama-server", type=Path, metavar="PATH", help="a built llama-server: skip the build")
    parser.add_argument("--llama-quantize", type=Path, metavar="PATH", help="a built llama-quantize: skip the build")
    parser.add_argument("--model", type=Path, metavar="FILE",
                        help="a GGUF file (default: the packaged SmolLM2-135M-Instruct Q4_1 of ember's default model)")
    parser.add_argument("--dtypes", type=_dtypes, default=CompareConfig.dtypes, metavar="D1,D2",
                        help="float32, bfloat16 or both (default: both)")
    parser.add_argument("--rounds", type=_positive_int, default=CompareConfig.rounds)
    parser.add_argument("--num-prompts", type=_positive_int, default=CompareConfig.num_prompts)
    parser.add_argument("--input-len", type=_positive_int, default=CompareConfig.input_len, help="random words a prompt")
    parser.add_argument("--output-len", type=_positive_int, default=CompareConfig.output_len, help="tokens a request")
    parser.add_argument("--concurrency", type=_positive_int, default=CompareConfig.concurrency,
                        help="requests in flight, and llama-server's slots (-np)")
    parser.add_argument("--threads", type=_positive_int, default=len(os.sched_getaffinity(0)),
                        help="llama-server's -t (default: the CPUs this process may run on, as ember serve uses)")
    parser.add_argument("--llama-weights", choices=["expanded", "stored"], default=CompareConfig.llama_weights,
                        help="llama-server serves the file as stored (its own quantized kernels; default) or "
                             "expanded to each dtype (the arithmetic of ember's --numerics exact)")
    parser.add_argument("--numerics", choices=["auto", "exact", "fast"], default=CompareConfig.numerics,
                        help="ember serve --numerics (auto: fast on a quantized file)")
    parser.add_argument("--output-json", type=Path, metavar="PATH", help="write the configuration and every number here")
    args = parser.parse_args(argv)
    needs_quantize = args.llama_weights == "expanded"
    if args.llama_cpp_dir is None and (args.llama_server is None or (needs_quantize and args.llama_quantize is None)):
        parser.error("give --llama-cpp-dir, or --llama-server and (to expand the file) --llama-quantize")
    return args


def main(argv: list[str] | None = None) -> int:
    from ember_bench.offline import environment
    from ember_bench.report import write_json

    args = parse_args(argv)
    config = CompareConfig(
        model=args.model or _default_model(), dtypes=args.dtypes, rounds=args.rounds, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, concurrency=args.concurrency, threads=args.threads,
        llama_weights=args.llama_weights, numerics=args.numerics,
    )
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = args.llama_cpp_dir or Path(scratch)
        work_dir.mkdir(parents=True, exist_ok=True)
        llama = _llama_cpp(args, work_dir)
        version = llama_cpp_version(llama.server)
        print(header(config, version), flush=True)
        runs = []
        for run in run_compare(config, llama, work_dir):
            runs.append(run)
            print(f"round {run.round} {run.dtype} {run.server}: {run.metrics.output_throughput:.1f} tok/s, "
                  f"{run.metrics.completed} completed, {run.metrics.failed} failed", file=sys.stderr, flush=True)
    print(compare_table(runs))
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "llama_cpp_compare", "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpu": cpu_name(), "environment": environment(), "llama_cpp": version,
            "config": {**asdict(config), "model": str(config.model), "llama_server_args": config.llama_server_args},
            "runs": runs,
            "ratios": {dtype: [throughput_ratio(runs, dtype, n) for n in range(1, config.rounds + 1)]
                       for dtype in config.dtypes},
        })
    return 0 if all(run.metrics.failed == 0 for run in runs if run.server == EMBER) else 1  # llama-server drops some


def _llama_cpp(args: argparse.Namespace, work_dir: Path) -> LlamaCpp:
    """The binaries given, the others from the build in --llama-cpp-dir."""
    if args.llama_server and (args.llama_quantize or args.llama_weights == "stored"):
        return LlamaCpp(args.llama_server, args.llama_quantize)
    bin_dir = build_llama_cpp(work_dir)
    return LlamaCpp(args.llama_server or bin_dir / "llama-server", args.llama_quantize or bin_dir / "llama-quantize")


if __name__ == "__main__":
    sys.exit(main())
