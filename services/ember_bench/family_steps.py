"""`ember bench families`: the decode step of every model family at the same shapes, against
Llama's. Each family's random checkpoint (its own switches: biases, q/k norms, soft-caps, windows,
partial rotary, extra norms) is written as a GGUF file and run by the in-process engine; a step is
timed once every sequence of the batch decodes, in interleaved rounds."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember_core.auto_dtype import DtypeChoice
from ember_core.config import EngineConfig
from ember_core.engine.engine import Engine
from ember_core.loaders import LoadedModel, load_model
from ember_core.sampling_params import SamplingParams

# One shape for all: Qwen2.5-0.5B's layer (hidden 896, 14 query and 2 KV heads of 64, MLP 4864) with
# fewer layers and a 32k vocabulary, so the layers, not the head, make the step.
SHAPE: dict[str, Any] = {
    "vocab_size": 32768, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 8,
    "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
}
# Each family's switches at the sizes its real models use: windows of 4096 (wider than the run's
# context, so every family attends over the same positions), Gemma's scalar, Phi-3's LongRoPE base.
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "gemma2": {"sliding_window": 4096, "query_pre_attn_scalar": 64},
    "gemma3": {"sliding_window": 4096, "query_pre_attn_scalar": 64},
    "phi3": {"original_max_position_embeddings": 4096},
}


KV_CACHE_MIB = 64  # 16 sequences of 154 tokens of any family's SHAPE fit


@dataclass(frozen=True)
class FamilyStep:
    family: str
    step_ms: float  # median decode step over the rounds' medians
    rounds_ms: list[float]

    def ratio_to(self, baseline: FamilyStep) -> float:
        return self.step_ms / baseline.step_ms


def family_gguf(family: str, out_dir: Path, file_type: str) -> Path:
    from ember_bench.gguf_export import export_gguf
    from ember_bench.random_models import random_checkpoint

    model_dir = random_checkpoint(family, out_dir / family, **SHAPE, **FAMILY_SETTINGS.get(family, {}))
    return export_gguf(model_dir, out_dir / f"{family}-{file_type}.gguf", file_type)


def decode_step_seconds(loaded: LoadedModel, model: str, dtype: str, batch: int, prompt_len: int, steps: int) -> list[float]:
    """Every step's time once all `batch` sequences decode (prefill done), for `steps` steps."""
    # A pool of about what the batch needs: a default-sized one per run costs page faults and reclaim
    # that land on whichever family runs next.
    engine = Engine(EngineConfig(model=model, max_num_seqs=batch, dtype=dtype, enable_prefix_caching=False,
                                 kv_cache_mib=KV_CACHE_MIB), loaded)
    generator = torch.Generator().manual_seed(0)
    for index in range(batch):
        prompt = torch.randint(10, loaded.vocab_size, (prompt_len,), generator=generator).tolist()
        engine.add_request(f"step-{index}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    started: set[str] = set()
    times: list[float] = []
    while engine.has_unfinished():
        start = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - start
        decoding = len(started) == batch
        started.update(delta.request_id for delta in deltas if delta.new_token_ids)
        if decoding and len(deltas) == batch:
            times.append(elapsed)
    return times[:steps]


def run_families(
    families: list[str], file_type: str, load_dtype: DtypeChoice, dtype: str, batch: int, prompt_len: int, steps: int,
    rounds: int, device: torch.device,
) -> Iterator[FamilyStep]:
    """Yield each family's median step after all rounds; every round runs every family, each round
    starting one family later, so none always runs first."""
    with tempfile.TemporaryDirectory(prefix="ember-families-") as scratch:
        models = {family: load_model(str(family_gguf(family, Path(scratch), file_type)), device, load_dtype)
                  for family in families}
        per_round: dict[str, list[float]] = {family: [] for family in families}
        for round_index in range(rounds):
            for family in families[round_index % len(families):] + families[: round_index % len(families)]:
                seconds = decode_step_seconds(models[family], family, dtype, batch, prompt_len, steps)
                per_round[family].append(statistics.median(seconds) * 1e3)
    for family in families:
        yield FamilyStep(family, statistics.median(per_round[family]), per_round[family])
