"""`python -m ember_bench.spec_decode`: n-gram speculative decoding against decoding without it, on
one GGUF file (the default model's unless --model says otherwise), in alternated rounds:

- one stream of copy-heavy chat prompts (repeat, correct, summarise a text; edit code), greedy: the
  time per output token, and that the text is the same with and without drafts;
- 16 streams of the shared workload (`--ignore-eos`): output tokens per second.

With --llama-server PATH, llama.cpp's server runs the one-stream prompts on the same file too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ember_bench.llama_cpp_compare import cpu_name
from ember_bench.llama_server import LlamaServer
from ember_bench.local_server import local_server, served_model
from ember_bench.serve import ServeConfig, run_serve
from ember_bench.stats import ServeMetrics
from ember_bench.workload import BenchRequest, load_workload
from ember_core.config import DEFAULT_MODEL
from ember_core.loaders.gguf_loader import FastGGUFReader
from ember_core.loaders.resolve import resolve_model
from ember_core.tokenizer.from_gguf import tokenizer_from_gguf

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
WORKLOAD = Path(__file__).with_name("workloads") / "smollm2.json"
PLAIN, SPEC, LLAMA = "ember", "ember + ngram", "llama-server"
TEXT = (
    "The lighthouse stood on the northern cliff for two hundred years. Its keeper, an old sailor named "
    "Tomas, climbed the one hundred and twelve steps every evening to light the lamp, and every morning he "
    "wrote the weather, the ships he had seen and the state of the sea in a leather book. When the storm of "
    "the winter came, the waves reached the windows of the lower rooms, but the light never went out."
)
CODE = '''def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def variance(values):
    average = mean(values)
    total = 0
    for value in values:
        total = total + (value - average) ** 2
    return total / len(values)
'''
ASKS = (
    f"Repeat this text exactly, word for word:\n\n{TEXT}",
    f"Correct the spelling and grammar of this text and write it out in full:\n\n{TEXT}",
    f"Summarise this text, quoting its sentences:\n\n{TEXT}",
    f"Rename the function `mean` to `average_of` in this code and write out the whole code:\n\n{CODE}",
)


@dataclass(frozen=True)
class Round:
    number: int
    server: str
    copy: ServeMetrics
    texts: list[str]
    streams: ServeMetrics | None  # the shared workload at 16 streams (ember only)


def copy_requests(model: Path, max_tokens: int) -> list[BenchRequest]:
    """The copy-heavy asks as chat prompts rendered by the model's template (sent to /v1/completions)."""
    tokenizer = tokenizer_from_gguf(FastGGUFReader(model))
    return [BenchRequest(tokenizer.render_chat([{"role": "user", "content": ask}]), max_tokens) for ask in ASKS]


@contextmanager
def _server(name: str, model: Path, llama_server: Path | None, log_dir: Path) -> Iterator[str]:
    if name == LLAMA:
        with LlamaServer(llama_server, model, log_dir / "llama-server.log", ("-np", "1", "-t", "2")) as running:
            yield running.url
        return
    extra = ["--speculative-config", json.dumps(SPECULATIVE)] if name == SPEC else []
    with local_server(str(model), 1, ["--dtype", "float32", *extra]) as (url, _):
        yield url


async def _texts(url: str, requests: list[BenchRequest]) -> list[str]:
    import aiohttp

    model = served_model(url)
    async with aiohttp.ClientSession() as session:
        texts = []
        for request in requests:
            body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                texts.append((await response.json())["choices"][0]["text"])
        return texts


def run_round(number: int, name: str, model: Path, copy: list[BenchRequest], workload: list[BenchRequest],
              llama_server: Path | None, log_dir: Path) -> Round:
    with _server(name, model, llama_server, log_dir) as url:
        single = asyncio.run(run_serve(ServeConfig(base_url=url, concurrency=1), copy)).metrics
        texts = asyncio.run(_texts(url, copy))
        streams = None
        if name != LLAMA:
            serve = ServeConfig(base_url=url, concurrency=16, ignore_eos=True)
            streams = asyncio.run(run_serve(serve, workload)).metrics
    return Round(number, name, single, texts, streams)


def report(rounds: list[Round], model: Path) -> str:
    lines = [f"# n-gram speculative decoding on {model.name}, {cpu_name()}", "",
             "| round | server | one stream, copy-heavy: TPOT p50 ms | tok/s | 16 streams, shared workload: tok/s |",
             "|---|---|---|---|---|"]
    for run in rounds:
        streams = f"{run.streams.output_throughput:.1f}" if run.streams else "-"
        lines.append(f"| {run.number} | {run.server} | {run.copy.tpot_ms.median:.1f} | "
                     f"{run.copy.output_throughput:.1f} | {streams} |")
    by = {name: [r for r in rounds if r.server == name] for name in (PLAIN, SPEC, LLAMA)}
    tpot = {name: statistics.mean(r.copy.tpot_ms.median for r in runs) for name, runs in by.items() if runs}
    lines += ["", f"one stream TPOT, ngram / without: {tpot[SPEC] / tpot[PLAIN]:.2f}x"]
    if LLAMA in tpot:
        lines.append(f"one stream TPOT, ngram / llama-server: {tpot[SPEC] / tpot[LLAMA]:.2f}x")
    pairs = zip(by[SPEC], by[PLAIN])
    lines.append("16 streams tok/s, ngram / without, per round: "
                 + ", ".join(f"{s.streams.output_throughput / p.streams.output_throughput:.3f}x" for s, p in pairs))
    same = all(s.texts == p.texts for s, p in zip(by[SPEC], by[PLAIN]))
    lines.append(f"greedy text the same with and without drafts: {'yes' if same else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember_bench.spec_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file or a name ember resolves to one")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160, help="of each copy-heavy prompt")
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary, to run the one-stream prompts too")
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    copy, workload = copy_requests(model, args.max_tokens), load_workload(WORKLOAD)
    order = [PLAIN, SPEC] + ([LLAMA] if args.llama_server else [])
    rounds = []
    with tempfile.TemporaryDirectory() as log_dir:
        for round_number in range(args.rounds):
            for name in order if round_number % 2 == 0 else order[::-1]:
                rounds.append(run_round(round_number + 1, name, model, copy, workload, args.llama_server, Path(log_dir)))
                print(f"round {round_number + 1}: {name} done", file=sys.stderr)
    print(report(rounds, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
