"""bfloat16 on CPU: ember's bf16 linear (AMX tiles, AVX512-BF16, or the float32 kernel, by the
build) over bf16 weights and GGUF blocks, the bf16 elementwise ops and the fused decode layer, each
against a float64 reference or the modules it replaces; a row's bits never depend on the rest of
the batch; and the real model gives a request the same tokens and logprobs alone and among 48."""

from __future__ import annotations

import copy

import gguf
import pytest
import torch
import torch.nn.functional as F

from ember_core import LLM, SamplingParams
from ember_core.kernels import cpu_ops
from ember_core.layers.linear import BF16_ROWS_FORMAT, GGUF_BLOCK_FORMATS
from ember_core.loaders import load_model
from ember_core.runner.inputs import SequenceChunk
from ember_core.runner.model_runner import ModelRunner
from tests.core.kernels.test_decoder_layer import BLOCK_SIZE, _assert_fused_layers_match_modules, tiny_model
from tests.core.layers.test_linear import _blocks
from tests.core.models.test_llama_hf import CASES, VOCAB, _hf_model
from tests.families import FAMILIES

pytestmark = pytest.mark.usefixtures("kernel")
BF16_ULP = 2**-8  # bfloat16's relative rounding step
Q = gguf.GGMLQuantizationType


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return cpu_ops.ops().bf16_linear(x, weight.view(torch.uint8), bias, BF16_ROWS_FORMAT, weight.shape[1])


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (64, 40), (1536, 96), (32, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_a_rounded_float32_sum_and_rows_do_not_depend_on_each_other(in_features: int, out_features: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(in_features + out_features)
    x = torch.randn(48, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    alone = torch.cat([bf16_linear(x[i : i + 1], weight, b) for i in range(48)])
    for rows in (0, 2, 3, 4, 5, 16, 17, 33, 48):
        assert torch.equal(bf16_linear(x[:rows], weight, b), alone[:rows]), rows
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    # one rounding to bfloat16 of a float32 sum: half a bf16 step, plus float32 sums of up to 1536 products
    torch.testing.assert_close(alone.double(), exact, rtol=BF16_ULP, atol=1e-3 * exact.abs().max().item())


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda kind: kind.name)
def test_blocks_give_the_bits_of_their_values_rounded_to_bf16(kind: gguf.GGMLQuantizationType) -> None:
    """What a bfloat16 model dequantized from the file computes, with native bf16; other builds
    multiply the blocks' float32 values, which are closer still to the float64 product."""
    blocks, values = _blocks(kind, 200, 512 // gguf.GGML_QUANT_SIZES[kind][0], seed=7)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(7)).bfloat16()
    actual = cpu_ops.ops().bf16_linear(x, blocks, None, GGUF_BLOCK_FORMATS[kind], 512)
    if "avx512_bf16" in cpu_ops.active_instruction_set().cpu_flags:
        assert torch.equal(actual, bf16_linear(x, values.bfloat16(), None))
    else:
        exact = F.linear(x.double(), values.double())
        torch.testing.assert_close(actual.double(), exact, rtol=BF16_ULP, atol=1e-3 * exact.abs().max().item())
    alone = torch.cat([cpu_ops.ops().bf16_linear(x[i : i + 1], blocks, None, GGUF_BLOCK_FORMATS[kind], 512) for i in range(20)])
    assert torch.equal(actual, alone)


def test_linear_rejects_what_it_cannot_compute() -> None:
    x, weight = torch.ones(2, 64).bfloat16(), torch.ones(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match="blocks must be a contiguous uint8 CPU tensor \\[out_features, 128\\]"):
        cpu_ops.ops().bf16_linear(x, weight, None, BF16_ROWS_FORMAT, 64)
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16 CPU tensor \\[m, 64\\]"):
        bf16_linear(x.float(), weight, None)
    with pytest.raises(RuntimeError, match="in_features must be a positive multiple of 32, got 48"):
        bf16_linear(torch.ones(2, 48).bfloat16(), torch.ones(8, 48).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous bfloat16 CPU tensor of 8 values"):
        bf16_linear(x, weight, torch.ones(8))


def test_elementwise_ops_round_once_from_float32() -> None:
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 576, generator=generator) * 3).bfloat16()
    weight = (torch.rand(576, generator=generator) + 0.5).bfloat16()
    normalised = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    expected = (weight.double() * normalised.double()).bfloat16()
    assert (cpu_ops.ops().rms_norm(x, weight, 1e-5).double() - expected.double()).abs().max() <= BF16_ULP * 8

    gate_up = torch.randn(5, 2 * 96, generator=generator).bfloat16()
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.ops().silu_and_mul(gate_up).double(), F.silu(gate) * up, rtol=BF16_ULP, atol=1e-6)

    heads = torch.randn(5, 3, 64, generator=generator).bfloat16()
    cos, sin = torch.randn(5, 64, generator=generator).bfloat16(), torch.randn(5, 64, generator=generator).bfloat16()
    rotated = torch.cat((-heads[..., 32:], heads[..., :32]), dim=-1).double()
    expected = heads.double() * cos[:, None].double() + rotated * sin[:, None].double()
    cpu_ops.ops().rotary_(heads, cos, sin)
    torch.testing.assert_close(heads.double(), expected, rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_fused_decode_layer_gives_the_modules_bits(family: str, tmp_path) -> None:
    model = tiny_model(family, tmp_path, torch.bfloat16)
    _assert_fused_layers_match_modules(ModelRunner(model, num_blocks=256, block_size=BLOCK_SIZE))


def test_a_request_gets_the_same_greedy_tokens_alone_and_among_48(smollm2_gguf_path) -> None:
    """The issue's case: alone, "The three primary colors are" once continued otherwise than as one
    of 48 copies in a batch (torch's bf16 GEMM sums a 336-row step in another order). With the
    default token budget the 48 prompts share one step."""
    llm = LLM(str(smollm2_gguf_path), dtype="bfloat16", num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompt = "The three primary colors are"
    alone = llm.generate([prompt], params)[0]
    together = llm.generate([prompt] * 48, params)
    assert [(out.token_ids, out.logprobs) for out in together] == [(alone.token_ids, alone.logprobs)] * 48


def test_a_split_prompt_gets_the_bits_of_a_whole_one(smollm2_gguf_path) -> None:
    """A step budget of 128 splits some of 48 prompts across steps; their chunks attend token by
    token, so nothing changes."""
    llm = LLM(str(smollm2_gguf_path), dtype="bfloat16", num_blocks=256, max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [f"Story {i}: once upon a time" for i in range(48)]
    alone = [llm.generate([prompt], params)[0] for prompt in prompts[:3]]
    together = llm.generate(prompts, params)[:3]
    assert [(o.token_ids, o.logprobs) for o in together] == [(o.token_ids, o.logprobs) for o in alone]


@pytest.mark.parametrize("case", ["gqa_tied", "linear_rope_biases"])
@torch.inference_mode()
def test_logits_are_as_close_to_float32_as_transformers_bfloat16(case: str, tmp_path) -> None:
    """A prompt's prefill and then a decode (the fused layer) in bfloat16, against transformers in
    float32: ember's bf16 may not stray further than transformers' own bf16 model does."""
    hf_model = _hf_model(case, **CASES[case])
    hf_model.save_pretrained(tmp_path)
    prompt = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = hf_model(torch.tensor([prompt])).logits[0]
    hf_bf16 = copy.deepcopy(hf_model).bfloat16()(torch.tensor([prompt])).logits[0].float()
    model = load_model(str(tmp_path), torch.device("cpu"), torch.bfloat16).model
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    table = list(range(-(-len(prompt) // BLOCK_SIZE)))
    prefill = model.compute_logits(runner.forward_hidden([SequenceChunk(prompt[:-1], 0, [table])]))
    decode = model.compute_logits(runner.forward_hidden([SequenceChunk(prompt[-1:], len(prompt) - 1, [table])]))
    ember = torch.cat([prefill, decode]).float()
    assert ember.dtype is torch.float32 and model.norm.weight.dtype is torch.bfloat16
    transformers_error = (hf_bf16 - reference).abs().max().item()
    assert (ember - reference).abs().max().item() <= 2 * transformers_error
