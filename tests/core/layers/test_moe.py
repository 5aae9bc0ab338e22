"""The experts kernel of a mixture-of-experts MLP (kernels/moe_experts.cpp) against torch's loop over
the same experts, its batch invariance, that it reads only the experts a step selected, and the
router's ties broken as transformers breaks them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from ember_core import LLM, SamplingParams
from ember_core.kernels import cpu_ops
from ember_core.layers.linear import GGUF_BLOCK_FORMATS, PLAIN_WEIGHT_FORMAT
from ember_core.layers.moe import Experts
from ember_core.models.registry import model_from_hf_config
from tests.families import hf_model, token_prompts

pytestmark = pytest.mark.skipif(not cpu_ops.is_available(), reason="ember's C++ CPU ops need a compiler")

EXPERTS, HIDDEN, EXPERT_SIZE, TOP_K = 8, 64, 96, 3
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    return ids, torch.rand(tokens, TOP_K, generator=generator)


def _experts(dtype: torch.dtype = torch.float32, seed: int = 0) -> Experts:
    generator = torch.Generator().manual_seed(seed)
    experts = Experts(EXPERTS, HIDDEN, EXPERT_SIZE, "silu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) * 0.2)
    return experts.to(dtype)


def _q8_0_experts(dense: Experts) -> Experts:
    """dense's weights as Q8_0 blocks (dense then holds their dequantized values)."""
    gate_up, down = (gguf.quants.quantize(w.detach().numpy(), Q8_0) for w in (dense.gate_up_proj, dense.down_proj))
    with torch.no_grad():
        dense.gate_up_proj.copy_(torch.from_numpy(gguf.quants.dequantize(gate_up, Q8_0)))
        dense.down_proj.copy_(torch.from_numpy(gguf.quants.dequantize(down, Q8_0)))
    blocks = Experts(EXPERTS, HIDDEN, EXPERT_SIZE, "silu")
    blocks.keep_blocks(torch.from_numpy(gate_up), GGUF_BLOCK_FORMATS[Q8_0], torch.from_numpy(down), GGUF_BLOCK_FORMATS[Q8_0])
    return blocks


@torch.inference_mode()
def test_the_kernel_computes_what_torchs_loop_over_the_experts_computes() -> None:
    experts = _experts()
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1))
    ids, weights = _routing(11)
    torch.testing.assert_close(experts(x, ids, weights), experts._forward_loop(x, ids, weights), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_blocks_give_the_bits_of_their_dequantized_weights() -> None:
    dense = _experts()
    blocks = _q8_0_experts(dense)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    ids, weights = _routing(9)
    assert torch.equal(blocks(x, ids, weights), dense(x, ids, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stored", ["dense", "Q8_0"])
@torch.inference_mode()
def test_a_tokens_output_does_not_depend_on_the_tokens_beside_it(dtype: torch.dtype, stored: str) -> None:
    dense = _experts()
    experts = (_q8_0_experts(dense) if stored == "Q8_0" else dense).to(dtype)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    ids, weights = _routing(20)
    weights = weights.to(dtype)
    batched = experts(x, ids, weights)
    for token in range(20):
        alone = experts(x[token : token + 1], ids[token : token + 1], weights[token : token + 1])
        assert torch.equal(alone[0], batched[token]), token
    # Tokens that share all their experts, in another order.
    order = torch.randperm(20, generator=torch.Generator().manual_seed(4))
    assert torch.equal(experts(x[order], ids[order], weights[order]), batched[order])


@torch.inference_mode()
def test_a_step_reads_only_the_experts_it_selected() -> None:
    """Unselected experts' blocks hold NaN scales: any read of them would show in the output."""
    blocks = _q8_0_experts(_experts())
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[0, 2, 5]] * 3 + [[5, 2, 0]] * 3)
    weights = torch.rand(6, TOP_K, generator=torch.Generator().manual_seed(6))
    expected = blocks(x, ids, weights)
    for unused in (1, 3, 4, 6, 7):
        blocks.gate_up_proj[unused].fill_(0xFF)  # a Q8_0 block's f16 scale 0xFFFF is NaN
        blocks.down_proj[unused].fill_(0xFF)
    result = blocks(x, ids, weights)
    assert torch.isfinite(result).all() and torch.equal(result, expected)


def test_the_kernel_rejects_expert_ids_out_of_range() -> None:
    experts = _experts()
    x = torch.randn(2, HIDDEN)
    with pytest.raises(RuntimeError, match="expert id 8 is not one of the 8 experts"):
        cpu_ops.ops().moe_experts(
            x, torch.tensor([[0, 8, 1], [1, 2, 3]]), torch.ones(2, TOP_K), experts.gate_up_proj, PLAIN_WEIGHT_FORMAT,
            experts.down_proj, PLAIN_WEIGHT_FORMAT, False,
        )


def _tied_router_checkpoint(path: Path) -> transformers.PreTrainedModel:
    """A Qwen3-MoE whose first layer's router scores every expert the same for every token."""
    model = hf_model("qwen3_moe")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.zero_()
    model.save_pretrained(path)
    return model


def test_router_ties_go_as_transformers_breaks_them(tmp_path: Path) -> None:
    model = _tied_router_checkpoint(tmp_path)
    prompts = token_prompts((4, 13))
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           generation_config=generation)[0, len(p) :].tolist()
            for p in prompts
        ]
    llm = LLM(str(tmp_path), num_blocks=64, block_size=4, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [output.token_ids for output in llm.generate(prompts, params)] == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be between 1 and the 8 experts, got 9"),
        ({"num_local_experts": 0}, "num_local_experts must be a positive integer"),
    ],
)
def test_bad_expert_configs_are_refused(change: dict, message: str) -> None:
    config = {**hf_model("qwen3_moe").config.to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        model_from_hf_config(json.loads(json.dumps(config)))


def test_olmoe_clip_qkv_is_refused() -> None:
    config = {**hf_model("olmoe").config.to_dict(), "clip_qkv": 8.0}
    with pytest.raises(ValueError, match="clip_qkv are not supported"):
        model_from_hf_config(config)


def test_qwen2_moe_without_qkv_biases() -> None:
    """Qwen2-MoE's config.json may turn its q, k and v biases off (qkv_bias), which Qwen 2 always has."""
    config = {**hf_model("qwen2_moe").config.to_dict(), "qkv_bias": False}
    assert not model_from_hf_config(config).config.qkv_bias
    assert model_from_hf_config(hf_model("qwen2_moe").config.to_dict()).config.qkv_bias
