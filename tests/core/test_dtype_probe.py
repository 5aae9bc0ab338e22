"""`--dtype auto` on CPU: the probe on the model's own linear shapes, what it logs, and that it
runs only where bfloat16 has native instructions."""

from __future__ import annotations

import logging

import pytest
import torch

from ember_core.config import DEFAULT_MODEL
from ember_core.device import cpu_has_fast_bf16
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
    assert dtype_probe._layer_linear_shapes(model) == [(64, 128), (64, 64), (64, 192), (96, 64)]
    with caplog.at_level(logging.INFO, logger="ember_core.runner.dtype_probe"):
        choice = dtype_probe.faster_cpu_dtype(model)
    assert choice in (torch.float32, torch.bfloat16)
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith(f"dtype auto: {str(choice).removeprefix('torch.')} (a decoder layer's linears at 16 rows: float32 ")


@pytest.mark.parametrize(("float32_seconds", "bfloat16_seconds", "expected"), [(2.0, 1.0, torch.bfloat16), (1.0, 2.0, torch.float32)])
def test_the_faster_dtype_is_chosen(monkeypatch: pytest.MonkeyPatch, float32_seconds, bfloat16_seconds, expected) -> None:
    """Timings are the machine's; here they are fixed to check the choice made from them."""
    timings = {torch.float32: float32_seconds, torch.bfloat16: bfloat16_seconds}
    monkeypatch.setattr(dtype_probe, "_seconds_per_pass", lambda shapes, dtype: timings[dtype])
    with torch.device("meta"):
        assert dtype_probe.faster_cpu_dtype(Decoder(TINY)) is expected


def test_the_loader_builds_the_model_in_the_chosen_dtype() -> None:
    loaded = load_model(DEFAULT_MODEL, CPU, lambda model: torch.bfloat16)
    assert loaded.dtype is torch.bfloat16
    assert loaded.model.norm.weight.dtype is torch.bfloat16
