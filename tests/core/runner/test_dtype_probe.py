"""`--dtype auto` on CPU: the probe on the model's own linear shapes, what it logs, and that it
runs only where bfloat16 has native instructions."""

from __future__ import annotations

import logging

import pytest
import torch

from ember_core.config import DEFAULT_MODEL
from ember_core.device import cpu_has_fast_bf16
from ember_core.kernels import cpu_ops
from ember_core.layers.linear import GGUFBlockLinear
from ember_core.loaders import load_model
from ember_core.models.decoder import Decoder
from ember_core.models.decoder_config import DecoderConfig
from ember_core.runner import dtype_probe

CPU = torch.device("cpu")
TINY = DecoderConfig.from_hf({
    "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96,
})  # fmt: skip


def test_explicit_dtypes_and_cpus_without_native_bf16_are_not_probed() -> None:
    assert dtype_probe.dtype_for_model("float32", CPU) is torch.float32
    assert dtype_probe.dtype_for_model("bf16", CPU) is torch.bfloat16
    expected = dtype_probe.faster_cpu_dtype if cpu_has_fast_bf16() else torch.float32
    assert dtype_probe.dtype_for_model("auto", CPU) == expected


def test_the_probe_times_one_layers_linears_in_both_dtypes_and_logs_the_figures(caplog: pytest.LogCaptureFixture) -> None:
    with torch.device("meta"):
        model = Decoder(TINY)
    shapes = [(linear.in_features, linear.out_features) for linear in dtype_probe._layer_linears(model)]
    assert shapes == [(64, 128), (64, 64), (64, 192), (96, 64)]
    with caplog.at_level(logging.INFO, logger="ember_core.runner.dtype_probe"):
        choice = dtype_probe.faster_cpu_dtype(model)
    assert choice in (torch.float32, torch.bfloat16)
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith(f"dtype auto: {str(choice).removeprefix('torch.')} (a decoder layer's linears at 16 rows: float32 ")


@pytest.mark.parametrize(("float32_seconds", "bfloat16_seconds", "expected"), [(2.0, 1.0, torch.bfloat16), (1.0, 2.0, torch.float32)])
def test_the_faster_dtype_is_chosen(monkeypatch: pytest.MonkeyPatch, float32_seconds, bfloat16_seconds, expected) -> None:
    """Timings are the machine's; here they are fixed to check the choice made from them."""
    timings = {torch.float32: float32_seconds, torch.bfloat16: bfloat16_seconds}
    monkeypatch.setattr(dtype_probe, "_seconds_per_pass", lambda linears, dtype: timings[dtype])
    with torch.device("meta"):
        assert dtype_probe.faster_cpu_dtype(Decoder(TINY)) is expected


def test_the_loader_builds_the_model_in_the_chosen_dtype() -> None:
    loaded = load_model(DEFAULT_MODEL, CPU, lambda model: torch.bfloat16)
    assert loaded.dtype is torch.bfloat16
    assert loaded.model.norm.weight.dtype is torch.bfloat16


def test_a_gguf_model_is_probed_on_its_own_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged SmolLM2 file keeps its layers in Q4_1 and Q8_0 blocks: the probe times those, which
    are widened as they are read, not dense weights of their shapes."""
    probed: list[list[torch.nn.Module]] = []
    time_for_real = dtype_probe._seconds_per_pass

    def seconds(linears: list[torch.nn.Module], dtype: torch.dtype) -> float:
        probed.append(linears)
        return 1.0 if dtype == torch.bfloat16 else 2.0

    monkeypatch.setattr(dtype_probe, "_seconds_per_pass", seconds)
    loaded = load_model(DEFAULT_MODEL, CPU, dtype_probe.faster_cpu_dtype)
    assert loaded.dtype is torch.bfloat16 and len(probed) == 2
    if cpu_ops.is_available():
        kinds = {linear.kind.name for linear in probed[0] if isinstance(linear, GGUFBlockLinear)}
        assert len(probed[0]) == 4 and kinds and kinds <= {"Q4_1", "Q8_0"}
        # the probe runs them for real: bfloat16 and float32 activations through the blocks
        assert time_for_real(probed[0], torch.bfloat16) > 0 and time_for_real(probed[0], torch.float32) > 0


def test_a_mixture_of_experts_layer_is_probed_whole_on_its_own_blocks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-MoE GGUF file: the probe runs the first layer's experts from the file's Q8_0 blocks,
    behind a router, in both dtypes."""
    from ember_bench.gguf_export import export_gguf
    from ember_core.layers.moe import SparseMoE
    from tests.families import write_checkpoint

    write_checkpoint("qwen3_moe", tmp_path, decoder_sparse_step=1)
    path = export_gguf(tmp_path, tmp_path / "moe.gguf", "Q8_0")
    probed: list[list[torch.nn.Module]] = []
    time_for_real = dtype_probe._seconds_per_pass

    def seconds(linears: list[torch.nn.Module], dtype: torch.dtype) -> float:
        probed.append(linears)
        return time_for_real(linears, dtype)

    monkeypatch.setattr(dtype_probe, "_seconds_per_pass", seconds)
    load_model(str(path), CPU, dtype_probe.faster_cpu_dtype)
    assert len(probed) == 2  # timed for real in float32 and in bfloat16
    (moe,) = [module for module in probed[0] if isinstance(module, SparseMoE)]
    if cpu_ops.is_available():
        assert moe.experts.gate_up_format != -1  # the file's blocks, not dense stand-ins
