"""prompt_logprobs: the logprob of every prompt token after the first (what echo + logprobs and
evaluation harnesses need), equal to the reference model's, whatever the chunking or preemption."""

from __future__ import annotations

import pytest
from transformers import GPT2LMHeadModel

from ember_core import LLM, SamplingParams
from tests.conftest import assert_pool_free, token_prompts
from tests.reference import reference_logits

PROMPTS = token_prompts(6, seed=21, min_len=2, max_len=50)
SCORING = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=2)


def _make_llm(gpt2_dir, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_blocks", 256)
    return LLM(str(gpt2_dir), device="cpu", dtype="float32", **kwargs)


def test_prompt_logprobs_equal_the_reference_models(gpt2_dir) -> None:
    reference = GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    for prompt, output in zip(PROMPTS, _make_llm(gpt2_dir).generate(PROMPTS, SCORING)):
        logprobs = reference_logits(reference, prompt).log_softmax(dim=-1)
        assert len(output.prompt_logprobs) == len(prompt) - 1
        for position, entry in enumerate(output.prompt_logprobs):
            assert entry.logprob == pytest.approx(logprobs[position, prompt[position + 1]].item(), abs=1e-5)
            top_values, top_ids = logprobs[position].topk(2)
            assert [token for token, _ in entry.top_logprobs] == top_ids.tolist()
            assert [value for _, value in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    "setting", [{"max_num_batched_tokens": 7}, {"num_blocks": 20}, {"num_blocks": 20, "max_num_batched_tokens": 7}]
)
def test_chunked_or_preempted_prompts_are_scored_once_with_the_same_values(gpt2_dir, setting) -> None:
    """Prompts split over steps, recomputed after preemption (20 blocks of 4 hold 80 tokens, less
    than the six prompts with their outputs), or both (preempted halfway through the prompt) give
    each prompt token exactly one entry."""
    expected = _make_llm(gpt2_dir).generate(PROMPTS, SCORING)
    llm = _make_llm(gpt2_dir, **setting)
    outputs = llm.generate(PROMPTS, SCORING)
    if "num_blocks" in setting:
        assert llm.stats().num_preemptions > 0
    for got, want in zip(outputs, expected):
        assert got.token_ids == want.token_ids
        # Other step batches may change BLAS's blocking, so values may move by an ulp or two (seen on
        # AVX-512 machines); an entry scored twice, or at the wrong position, is off by far more.
        assert [e.logprob for e in got.prompt_logprobs] == pytest.approx([e.logprob for e in want.prompt_logprobs], abs=1e-5)
    assert_pool_free(llm)


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(gpt2_dir) -> None:
    llm = _make_llm(gpt2_dir)
    scored = llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=1))
    expected = llm.generate(PROMPTS, SCORING)
    for got, want in zip(scored, expected):
        assert got.token_ids == [] and got.finish_reason == "length"
        assert [e.logprob for e in got.prompt_logprobs] == pytest.approx([e.logprob for e in want.prompt_logprobs], abs=1e-6)
    assert_pool_free(llm)


def test_without_prompt_logprobs_none_are_computed(gpt2_dir) -> None:
    output = _make_llm(gpt2_dir).generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0))[0]
    assert output.prompt_logprobs is None


def test_negative_prompt_logprobs_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=-1)
