"""`ember bench offline`: the in-process engine on one workload, every request submitted at once,
across engine settings and max_num_seqs values, in interleaved rounds; optionally a transformers
baseline in the same run."""

from __future__ import annotations

import importlib.util
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ember_bench.offline_runs import EngineSetting, OfflineRun, offline_run
from ember_bench.workload import BenchRequest, RandomPrompts, take
from ember_core.auto_dtype import requested_dtype
from ember_core.config import EngineConfig
from ember_core.device import resolve_device
from ember_core.engine.engine import Engine
from ember_core.loaders import LoadedModel, load_model
from ember_core.sampling_params import SamplingParams
from ember_core.tokenizer import Tokenizer
from ember_proto import StructuredOutputs

WARMUP_TOKENS = 2
# The structured_outputs setting's constraint: a JSON object whose one string is longer than any
# run, so a constrained request generates max_tokens tokens, as an unconstrained one with ignore_eos.
LONG_JSON = StructuredOutputs(
    json='{"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}'
)


@dataclass(frozen=True)
class OfflineConfig:
    model: str
    settings: list[EngineSetting]
    concurrencies: list[int]
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # block_size, num_blocks, kv_cache_mib, ...
    transformers: bool = False
    num_prompts: int | None = None
    rounds: int = 1

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"--concurrency needs integers >= 1, got {self.concurrencies}")
        if self.rounds < 1:
            raise ValueError(f"--rounds needs an integer >= 1, got {self.rounds}")
        if self.transformers and importlib.util.find_spec("transformers") is None:
            raise ValueError("--transformers needs the transformers package (pip install transformers)")


def run_offline(config: OfflineConfig, source: list[BenchRequest] | RandomPrompts) -> Iterator[OfflineRun]:
    """Yield each run as it finishes: per round, setting (models loaded once per dtype and GGUF weights) and
    concurrency. Every round runs every setting, so a machine that slows down mid-sweep slows them all alike;
    the transformers baseline runs once, after the rounds."""
    device = resolve_device(config.engine_kwargs.get("device"))
    loaded_models: dict[tuple[str, str, str], LoadedModel] = {}

    def loaded(setting: EngineSetting) -> LoadedModel:
        key = (setting.dtype, setting.gguf_weights, setting.numerics)
        if key not in loaded_models:
            dtype = requested_dtype(setting.dtype, device)
            loaded_models[key] = load_model(
                config.model, device, dtype, compact_weights=setting.gguf_weights == "blocks", numerics=setting.numerics
            )
        return loaded_models[key]

    first = loaded(config.settings[0])
    requests = take(_requests(source, first), config.num_prompts)
    prompts = [_token_ids(r.prompt, first.tokenizer) for r in requests]
    max_tokens = [r.max_tokens for r in requests]
    for round_number in range(1, config.rounds + 1):
        for setting in config.settings:
            for concurrency in config.concurrencies:
                run = _run_ember(loaded(setting), config, setting, concurrency, prompts, max_tokens)
                yield replace(run, round=round_number)
    if config.transformers:
        from ember_bench.hf_baseline import run_transformers

        for dtype in dict.fromkeys(s.dtype for s in config.settings):
            yield from run_transformers(config.model, dtype, device, config.concurrencies, prompts, max_tokens)


def environment() -> dict[str, Any]:
    """What the numbers depend on besides the configuration."""
    return {
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        # Other processes on the machine skew every number; a load well above zero says to rerun.
        "load_average_1m": os.getloadavg()[0],
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
    }


def _requests(source: list[BenchRequest] | RandomPrompts, loaded: LoadedModel) -> list[BenchRequest]:
    if isinstance(source, RandomPrompts):
        return source.words() if loaded.tokenizer is not None else source.token_ids(loaded.vocab_size)
    return source


def _token_ids(prompt: str | list[int], tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if tokenizer is None:
        raise ValueError("this model has no tokenizer files: use --random-prompts or a workload of token-id prompts")
    return tokenizer.encode_prompt(prompt)


def _run_ember(
    loaded: LoadedModel, config: OfflineConfig, setting: EngineSetting, concurrency: int,
    prompts: list[list[int]], max_tokens: list[int],
) -> OfflineRun:
    engine_config = EngineConfig(
        model=config.model, max_num_seqs=concurrency, batching=setting.batching, admission=setting.admission,
        dtype=setting.dtype, gguf_weights=setting.gguf_weights, enable_prefix_caching=setting.prefix_caching,
        numerics=setting.numerics,
        **config.engine_kwargs,
    )
    # A tensor-parallel engine loads its ranks' parts itself, and stops their processes after the run.
    engine = Engine(engine_config, loaded if engine_config.tensor_parallel_size == 1 else None)
    try:
        return _measured_run(engine, setting, concurrency, prompts, max_tokens)
    finally:
        engine.close()


def _measured_run(
    engine: Engine, setting: EngineSetting, concurrency: int, prompts: list[list[int]], max_tokens: list[int]
) -> OfflineRun:
    constraint = LONG_JSON if setting.structured_outputs else None  # compiled in the warm-up
    warmup = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, structured_outputs=constraint)
    _drain(engine, {"warmup": (prompts[0], warmup)})
    engine.block_manager.reset_prefix_cache()  # the measured run computes every prompt
    batch = {
        f"bench-{i}": (ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, structured_outputs=constraint))
        for i, (ids, n) in enumerate(zip(prompts, max_tokens))
    }
    before = engine.stats()
    start = time.perf_counter()
    latencies, output_tokens = _drain(engine, batch)
    duration_s = time.perf_counter() - start
    after = engine.stats()
    return replace(
        offline_run("ember", setting, concurrency, latencies, output_tokens, duration_s, after.num_preemptions - before.num_preemptions),
        prefix_cache_hits=after.num_prefix_cache_hits - before.num_prefix_cache_hits,
    )


def _drain(engine: Engine, batch: dict[str, tuple[list[int], SamplingParams]]) -> tuple[list[float], int]:
    """Submit every request, step until all finish; each request's completion time and the token count."""
    start = time.perf_counter()
    for request_id, (prompt_ids, params) in batch.items():
        engine.add_request(request_id, prompt_ids, params)
    latencies: list[float] = []
    output_tokens = 0
    while engine.has_unfinished():
        for delta in engine.step():
            output_tokens += len(delta.new_token_ids)
            if delta.finish_reason is not None:
                latencies.append(time.perf_counter() - start)
    return latencies, output_tokens
