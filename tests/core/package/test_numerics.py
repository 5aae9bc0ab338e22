"""The numerics setting (ember_core/numerics.py): what `auto` picks, a float checkpoint opting into
`fast` (its linears and experts quantized to Q8_0 at load, routers left float), how far that lands
from `exact`, and the settings refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_bench.fidelity import window_logits
from ember_core import LLM, SamplingParams
from ember_core.config import EngineConfig
from ember_core.layers.linear import GGUFBlockLinear
from ember_core.layers.moe import Experts, SparseMoE
from ember_core.loaders.load import load_model
from ember_core.numerics import resolve_numerics
from tests.families import token_prompts, write_checkpoint

KQUANTS = Path(__file__).parents[1] / "data" / "kquants"
CPU = torch.device("cpu")


@pytest.mark.usefixtures("kernel")
def test_auto_is_fast_for_a_quantized_file_and_exact_for_a_float_checkpoint(gpt2_dir: Path) -> None:
    assert load_model(str(KQUANTS / "llama-Q4_K_M.gguf"), CPU, torch.float32, numerics="auto").numerics == "fast"
    assert load_model(str(gpt2_dir), CPU, torch.float32, numerics="auto").numerics == "exact"
    exact = load_model(str(KQUANTS / "llama-Q4_K_M.gguf"), CPU, torch.float32, numerics="exact").model
    assert not any(getattr(module, "int8", False) for module in exact.modules())


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@torch.inference_mode()
def test_a_float_checkpoint_opts_into_fast_with_q8_0_weights(family: str, tmp_path: Path) -> None:
    write_checkpoint(family, tmp_path)
    exact = load_model(str(tmp_path), CPU, torch.float32, numerics="exact")
    fast = load_model(str(tmp_path), CPU, torch.float32, numerics="fast")
    assert fast.numerics == "fast"
    linears = [module for module in fast.model.modules() if isinstance(module, GGUFBlockLinear)]
    assert linears and all(linear.int8 and linear.kind.name == "Q8_0" for linear in linears)
    for moe in (module for module in fast.model.modules() if isinstance(module, SparseMoE)):
        assert not isinstance(moe.gate, GGUFBlockLinear)  # routers pick experts: they stay float
        assert isinstance(moe.experts, Experts) and moe.experts.int8
    # Q8_0 weights and int8 activations, 4 layers: measured mean KL 0.0021 (llama; 0.0009 from the Q8_0
    # weights alone) and 0.0007 (qwen3_moe), the largest logit error 3.5% of the logits' range.
    prompt = token_prompts((40,))[0]
    reference, quantized = window_logits(exact.model, prompt, 0), window_logits(fast.model, prompt, 0)
    assert (quantized - reference).abs().max() <= 0.05 * (reference.max() - reference.min())
    kl = torch.nn.functional.kl_div(quantized.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none")
    assert kl.sum(-1).mean() <= 0.005


@pytest.mark.usefixtures("kernel")
def test_the_engine_reports_and_runs_the_numerics_it_was_given(gpt2_dir: Path) -> None:
    llm = LLM(str(gpt2_dir), device="cpu", dtype="bfloat16", numerics="fast", num_blocks=64, block_size=4)
    assert (llm.engine.loaded.numerics, llm.engine.loaded.dtype) == ("fast", torch.bfloat16)
    output = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 4


def test_settings_fast_cannot_run_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="numerics must be one of auto, exact, fast"):
        EngineConfig(numerics="fastest")
    with pytest.raises(ValueError, match="--numerics fast runs on ember's C\\+\\+ CPU kernels, not on cuda"):
        resolve_numerics("fast", True, torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="not float16"):
        resolve_numerics("fast", True, CPU, torch.float16)
    # auto falls back to exact where fast cannot run, quantized file or not
    assert resolve_numerics("auto", True, torch.device("cuda"), torch.float32) == "exact"
    assert resolve_numerics("auto", True, CPU, torch.float16) == "exact"
