"""`ember bench determinism`: replays a set of requests many times in the offline engine under random
batch mixes, prefix-cache hits and prefill chunk sizes, and counts the distinct outputs each request
gave, bit for bit: its tokens, their logprobs and top logprobs. The promise is one per request.

The requests are the shipped workload's prompts, every other one lengthened by the three prompts
after it (so a long prompt starts with a short one's text, and finds its blocks cached), each
asked greedily and as a seeded sample. The first replay runs every request alone; each later one
takes a random subset in a random order, on one of three engines that cut prompts differently
(whole prompts with 16 sequences, 200-token chunks with 4, 37-token chunks with 2, so requests
queue and join others' decodes), after forgetting the prefix cache half of the time. Throughput
is the output tokens of all replays over the time they took.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ember_bench.workload import load_workload
from ember_core import LLM, SamplingParams

WORKLOAD = Path(__file__).with_name("workloads") / "smollm2.json"
# (max_num_batched_tokens, max_num_seqs) of each engine a replay may run on
ENGINE_SHAPES = ((4096, 16), (200, 4), (37, 2))
PROMPTS_PER_LONG_PROMPT = 4


@dataclass(frozen=True)
class DeterminismConfig:
    model: str
    dtype: str = "auto"
    numerics: str = "auto"
    prompts: int = 8
    replays: int = 24
    max_tokens: int = 16
    top_logprobs: int = 5
    seed: int = 0


@dataclass(frozen=True)
class BenchedRequest:
    name: str
    prompt: str
    params: SamplingParams


@dataclass(frozen=True)
class RequestOutcome:
    name: str
    runs: int
    distinct_outputs: int


@dataclass(frozen=True)
class DeterminismReport:
    outcomes: list[RequestOutcome]
    output_tokens: int
    seconds: float
    # Each engine's dtype, numerics, KV cache dtype and CPU build, as it resolved them at start
    engine_settings: list[str]

    @property
    def deterministic(self) -> bool:
        return all(outcome.distinct_outputs == 1 for outcome in self.outcomes) and len(set(self.engine_settings)) == 1

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def benched_requests(config: DeterminismConfig) -> list[BenchedRequest]:
    texts = [request.prompt for request in load_workload(WORKLOAD)]
    if not 1 <= config.prompts <= len(texts):
        raise ValueError(f"--prompts must be between 1 and {len(texts)} (the workload's prompts), got {config.prompts}")
    requests = []
    for i in range(config.prompts):
        lengthened = i % 2 == 1
        prompt = " ".join(texts[(i + j) % len(texts)] for j in range(PROMPTS_PER_LONG_PROMPT if lengthened else 1))
        kind = "long" if lengthened else "short"
        requests += [
            BenchedRequest(f"{i}-{kind}-greedy", prompt, _params(config, temperature=0.0)),
            BenchedRequest(f"{i}-{kind}-seeded", prompt, _params(config, temperature=0.8, seed=config.seed + i)),
        ]
    return requests


def _params(config: DeterminismConfig, temperature: float, seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=seed, top_p=0.95 if temperature else 1.0, max_tokens=config.max_tokens,
        ignore_eos=True, logprobs=config.top_logprobs,
    )


def run_determinism(config: DeterminismConfig) -> DeterminismReport:
    if config.replays < 2:
        raise ValueError(f"--replays must be at least 2 (the first runs each request alone), got {config.replays}")
    requests = benched_requests(config)
    engines = [
        LLM(config.model, dtype=config.dtype, numerics=config.numerics, max_num_batched_tokens=tokens, max_num_seqs=seqs)
        for tokens, seqs in ENGINE_SHAPES
    ]
    rng = random.Random(config.seed)
    outputs: dict[str, set[tuple]] = {request.name: set() for request in requests}
    runs = dict.fromkeys(outputs, 0)
    output_tokens, seconds = 0, 0.0
    for replay in range(config.replays):
        if replay == 0:
            batches, llm = [[request] for request in requests], engines[0]
        else:
            batches, llm = [rng.sample(requests, rng.randint(2, len(requests)))], rng.choice(engines)
            if rng.random() < 0.5:
                llm.reset_prefix_cache()
        for batch in batches:
            if replay == 0:
                llm.reset_prefix_cache()
            started = time.perf_counter()
            results = llm.generate([request.prompt for request in batch], [request.params for request in batch], use_tqdm=False)
            seconds += time.perf_counter() - started
            for request, result in zip(batch, results):
                outputs[request.name].add(_fingerprint(result.token_ids, result.logprobs))
                runs[request.name] += 1
                output_tokens += len(result.token_ids)
    outcomes = [RequestOutcome(request.name, runs[request.name], len(outputs[request.name])) for request in requests]
    return DeterminismReport(outcomes, output_tokens, seconds, [_settings(llm) for llm in engines])


def _settings(llm: LLM) -> str:
    loaded = llm.engine.loaded
    return f"{str(loaded.dtype).removeprefix('torch.')}, {loaded.numerics}, KV {llm.engine.kv_cache_dtype}, {loaded.cpu_build}"


def _fingerprint(token_ids: Sequence[int], logprobs: Sequence) -> tuple:
    return tuple(token_ids), tuple((t.token_id, t.logprob, tuple(map(tuple, t.top_logprobs))) for t in logprobs)


def determinism_table(report: DeterminismReport) -> str:
    rows = [f"| {outcome.name} | {outcome.runs} | {outcome.distinct_outputs} |" for outcome in report.outcomes]
    verdict = "every request gave one output" if report.deterministic else "SOME REQUESTS GAVE SEVERAL OUTPUTS"
    if len(set(report.engine_settings)) > 1:
        verdict += f"; THE ENGINES RESOLVED DIFFERENT SETTINGS: {' / '.join(report.engine_settings)}"
    return "\n".join([
        "| request | runs | distinct outputs (tokens + logprobs, bitwise) |", "|---|---|---|", *rows, "",
        f"engines: {' / '.join(dict.fromkeys(report.engine_settings))}",
        f"{verdict}; {report.output_tokens} output tokens in {report.seconds:.1f} s: {report.tokens_per_s:.1f} tok/s",
    ])
