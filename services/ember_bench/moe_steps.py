"""`ember bench moe`: a mixture of experts' decode step against the dense model of its active size.

Two random checkpoints of the same layers and attention (ember_bench.random_models' presets
qwen3-moe-bench and qwen3-dense-bench: 8 layers, hidden 1024; 32 experts of 512, top-4, against one
MLP of 4 x 512), written as GGUF files of one type and run by the in-process engine. At each batch
size both decode steps are timed in interleaved rounds, and the experts each sparse layer ran are
counted. The kernel reads each selected expert once a step, the least this routing allows (a test
poisons the unselected ones); against it, all experts' weights (running every expert) and the
per-token reads (each token's top-k experts read for it alone, batch x top_k a layer).
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember_bench.family_steps import decode_step_seconds
from ember_core.auto_dtype import DtypeChoice
from ember_core.layers.moe import Experts
from ember_core.loaders import LoadedModel, load_model

MOE_PRESET, DENSE_PRESET = "qwen3-moe-bench", "qwen3-dense-bench"


@dataclass(frozen=True)
class MoEStep:
    batch: int
    moe_ms: float  # median over the rounds' medians
    dense_ms: float
    experts_per_layer: float  # distinct experts a sparse layer ran, per decode step (mean)
    expert_mb_read: float  # the experts' weights a decode step read, MB: each selected expert once
    all_experts_mb: float  # every expert of every sparse layer, MB
    per_token_mb: float  # batch x top_k experts a layer: each token's experts read for it alone, MB

    @property
    def ratio(self) -> float:
        return self.moe_ms / self.dense_ms


def preset_gguf(preset: str, out_dir: Path, file_type: str, overrides: dict[str, Any]) -> Path:
    from ember_bench.gguf_export import export_gguf
    from ember_bench.random_models import PRESETS, random_checkpoint

    family, _ = PRESETS[preset]
    model_dir = random_checkpoint(family, out_dir / preset, preset=preset, **overrides)
    return export_gguf(model_dir, out_dir / f"{preset}-{file_type}.gguf", file_type)


class ExpertCounter:
    """Counts the distinct experts each call of a model's Experts modules runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [module for module in model.modules() if isinstance(module, Experts)]
        self.calls = self.distinct = 0
        self.handles = [module.register_forward_hook(self._count) for module in self.modules]

    def _count(self, module: Experts, inputs: tuple, output: torch.Tensor) -> None:
        self.calls += 1
        self.distinct += len(inputs[1].unique())

    def bytes_per_expert(self) -> int:
        experts = self.modules[0]
        return experts.gate_up_proj[0].nbytes + experts.down_proj[0].nbytes

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _timed(loaded: LoadedModel, name: str, dtype: str, batch: int, prompt_len: int, steps: int) -> float:
    return statistics.median(decode_step_seconds(loaded, name, dtype, batch, prompt_len, steps)) * 1e3


def run_moe_steps(
    file_type: str, load_dtype: DtypeChoice, dtype: str, batches: list[int], prompt_len: int, steps: int, rounds: int,
    device: torch.device, overrides: dict[str, Any] | None = None,
) -> Iterator[MoEStep]:
    """overrides: config values over both presets (the tests' smaller shapes)."""
    with tempfile.TemporaryDirectory(prefix="ember-moe-") as scratch:
        moe = load_model(str(preset_gguf(MOE_PRESET, Path(scratch), file_type, overrides or {})), device, load_dtype)
        dense = load_model(str(preset_gguf(DENSE_PRESET, Path(scratch), file_type, overrides or {})), device, load_dtype)
        moe_config = moe.model.config.moe
        for batch in batches:
            timings: dict[str, list[float]] = {"moe": [], "dense": []}
            for round_index in range(rounds):
                order = [("moe", moe), ("dense", dense)]
                for name, loaded in order[round_index % 2 :] + order[: round_index % 2]:
                    timings[name].append(_timed(loaded, name, dtype, batch, prompt_len, steps))
            counter = ExpertCounter(moe.model)
            try:
                # Counted over decode steps alone: prefill (prompt_len tokens a sequence) selects more.
                decode_step_seconds(moe, "moe", dtype, batch, 1, steps)
                per_layer = counter.distinct / counter.calls
                per_expert_mb = counter.bytes_per_expert() / 1e6
                sparse_layers = len(counter.modules)
            finally:
                counter.close()
            yield MoEStep(
                batch=batch,
                moe_ms=statistics.median(timings["moe"]),
                dense_ms=statistics.median(timings["dense"]),
                experts_per_layer=per_layer,
                expert_mb_read=per_layer * per_expert_mb * sparse_layers,
                all_experts_mb=moe_config.num_experts * per_expert_mb * sparse_layers,
                per_token_mb=batch * moe_config.top_k * per_expert_mb * sparse_layers,
            )
