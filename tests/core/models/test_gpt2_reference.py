"""ember's GPT-2 against transformers' GPT2LMHeadModel on the same random-weight checkpoint."""

from __future__ import annotations

import pytest
import torch

from ember_core import SamplingParams
from tests.conftest import assert_pool_free, token_prompts, write_gpt2_checkpoint
from tests.reference import ember_prompt_logits, reference_greedy, reference_logits


@pytest.fixture(scope="module")
def hf_gpt2(gpt2_dir):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(gpt2_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("prompt", token_prompts(4, seed=3, min_len=1, max_len=60))
def test_prompt_logits_match_transformers(gpt2_llm, hf_gpt2, prompt) -> None:
    ours = ember_prompt_logits(gpt2_llm, prompt)
    theirs = reference_logits(hf_gpt2, prompt)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_decode_logprobs_match_transformers_at_every_step(gpt2_llm, hf_gpt2) -> None:
    prompt = token_prompts(1, seed=5)[0]
    top = 20  # the most SamplingParams allows, as vLLM's default max_logprobs
    out = gpt2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=top))[0]
    ids = prompt + out.token_ids
    theirs = reference_logits(hf_gpt2, ids).log_softmax(-1)
    for step, token_logprob in enumerate(out.logprobs):
        row = theirs[len(prompt) - 1 + step]
        values, token_ids = row.topk(top)
        assert [token_id for token_id, _ in token_logprob.top_logprobs] == token_ids.tolist()
        ours = torch.tensor([value for _, value in token_logprob.top_logprobs])
        assert (ours - values).abs().max().item() < 1e-4
        assert abs(token_logprob.logprob - row[out.token_ids[step]].item()) < 1e-4
    assert_pool_free(gpt2_llm)


def test_greedy_continuations_match_transformers(gpt2_llm, hf_gpt2) -> None:
    prompts = token_prompts(6, seed=7)
    outs = gpt2_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(hf_gpt2, prompt, 16)
        assert out.finish_reason == "length"
    assert_pool_free(gpt2_llm)


def test_conv1d_checkpoint_without_transformer_prefix_and_pytorch_bin(tmp_path) -> None:
    """The original `gpt2` repo stores unprefixed names in pytorch_model.bin; both layouts load."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from ember_core import LLM

    src = write_gpt2_checkpoint(tmp_path / "src", seed=11, activation_function="gelu_new", scale_attn_by_inverse_layer_idx=True)
    dst = tmp_path / "bin"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = {k.removeprefix("transformer."): v for k, v in load_file(src / "model.safetensors").items()}
    torch.save(state, dst / "pytorch_model.bin")
    reference = GPT2LMHeadModel.from_pretrained(src, dtype=torch.float32).eval()
    llm = LLM(str(dst), block_size=16, num_blocks=64, device="cpu", dtype="float32")
    prompt = token_prompts(1, seed=13)[0]
    assert (ember_prompt_logits(llm, prompt) - reference_logits(reference, prompt)).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "overrides", [{"scale_attn_weights": False}, {"tie_word_embeddings": False}], ids=["unscaled_attention", "untied_head"]
)
def test_config_variants_match_transformers(tmp_path, overrides) -> None:
    from transformers import GPT2LMHeadModel

    from ember_core import LLM

    src = write_gpt2_checkpoint(tmp_path / "src", seed=17, **overrides)
    reference = GPT2LMHeadModel.from_pretrained(src, dtype=torch.float32).eval()
    if "tie_word_embeddings" in overrides:
        assert not torch.equal(reference.lm_head.weight, reference.transformer.wte.weight)
    llm = LLM(str(src), block_size=16, num_blocks=64, device="cpu", dtype="float32")
    prompt = token_prompts(1, seed=19)[0]
    assert (ember_prompt_logits(llm, prompt) - reference_logits(reference, prompt)).abs().max().item() < 1e-4
