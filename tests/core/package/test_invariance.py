"""Greedy fp32 output depends on (weights, prompt) only: not on block size, batch, preemption,
admission policy, batching mode or prefill chunking. Every load ends with the pool fully free."""

from __future__ import annotations

import pytest

from ember_core import LLM, SamplingParams
from tests.conftest import assert_pool_free, token_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = token_prompts(6, seed=21, min_len=2, max_len=50)


def make_llm(gpt2_dir, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 16)
    kwargs.setdefault("num_blocks", 256)
    return LLM(str(gpt2_dir), device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def expected(gpt2_dir) -> list[list[int]]:
    llm = make_llm(gpt2_dir)
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]  # each prompt alone


@pytest.mark.parametrize("block_size", [1, 2, 3, 7, 16, 64])
def test_block_size_does_not_change_tokens(gpt2_dir, expected, block_size) -> None:
    llm = make_llm(gpt2_dir, block_size=block_size, num_blocks=4096 // block_size)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert_pool_free(llm)


def test_batched_with_other_lengths_equals_alone(gpt2_dir, expected) -> None:
    llm = make_llm(gpt2_dir)
    outs = llm.generate(PROMPTS[::-1], GREEDY)
    assert [o.token_ids for o in outs[::-1]] == expected
    assert_pool_free(llm)


@pytest.mark.parametrize("admission", ["preempt", "reserve"])
def test_squeezed_pool_gives_identical_tokens(gpt2_dir, expected, admission) -> None:
    # 20 blocks of 4 tokens: every prompt fits alone but not all of them together.
    llm = make_llm(gpt2_dir, block_size=4, num_blocks=20, admission=admission)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    if admission == "preempt":
        assert llm.stats().num_preemptions > 0
    else:
        assert llm.stats().num_preemptions == 0
    assert_pool_free(llm)


def test_static_batching_equals_continuous(gpt2_dir, expected) -> None:
    llm = make_llm(gpt2_dir, batching="static", max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert_pool_free(llm)


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_does_not_change_tokens(gpt2_dir, expected, chunk) -> None:
    llm = make_llm(gpt2_dir, max_num_batched_tokens=chunk, max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert_pool_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "int8", "fp8_e4m3"])
def test_narrower_kv_cache_keeps_batch_and_chunk_invariance(gpt2_dir, kv_cache_dtype) -> None:
    """Rounded or quantized K/V change the tokens a little, but batching and prefill chunking still do not."""
    llm = make_llm(gpt2_dir, kv_cache_dtype=kv_cache_dtype)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS[::-1], GREEDY)][::-1] == alone
    chunked = make_llm(gpt2_dir, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=7, max_num_seqs=4)
    assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY)] == alone
    assert_pool_free(llm)
    assert_pool_free(chunked)


def test_a_cache_dtype_the_kernel_lacks_falls_back_to_sdpa_and_says_so(gpt2_dir, caplog) -> None:
    llm = LLM(str(gpt2_dir), device="cpu", dtype="bfloat16", kv_cache_dtype="float16", block_size=16, num_blocks=64)
    assert llm.engine.runner.decode_attention == "sdpa"
    assert "does not take a torch.bfloat16 model over a torch.float16 KV cache" in caplog.text
    outputs = llm.generate(PROMPTS[:2], GREEDY)
    assert [len(o.token_ids) for o in outputs] == [GREEDY.max_tokens] * 2
    assert_pool_free(llm)


def test_sdpa_fallback_decode_gives_the_same_tokens_as_the_kernel(gpt2_dir, expected, monkeypatch, caplog) -> None:
    from ember_core.kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "is_available", lambda: False)
    llm = make_llm(gpt2_dir)
    assert llm.engine.runner.decode_attention == "sdpa"
    assert "C++ CPU ops are unavailable" in caplog.text  # the slow path is not silent
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert_pool_free(llm)


RESUMED = [
    GREEDY,
    SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=20, frequency_penalty=1.5, presence_penalty=0.5),
]


@pytest.mark.parametrize("params", RESUMED, ids=["greedy", "seeded", "seeded-with-penalties"])
def test_a_request_resumed_after_its_first_tokens_goes_on_with_the_same_tokens(gpt2_dir, params) -> None:
    """As a gateway resumes its requests on a restarted engine: the tokens it already had count as
    output (max_tokens, penalties, the seed's position), so the rest is what it would have been."""
    llm = make_llm(gpt2_dir)
    prompt = PROMPTS[1]
    whole = llm.generate([prompt], params)[0].token_ids
    assert len(whole) == 20
    for kept in (1, 9, 19):
        llm.engine.add_request("resumed", prompt, params, output_token_ids=whole[:kept])
        rest = []
        while llm.engine.has_unfinished():
            rest += [token for delta in llm.engine.step() for token in delta.new_token_ids]
        assert whole[:kept] + rest == whole
    assert_pool_free(llm)


def test_a_resumed_request_with_no_tokens_left_is_rejected(gpt2_dir) -> None:
    from ember_core.engine.engine import RequestRejected

    llm = make_llm(gpt2_dir)
    with pytest.raises(RequestRejected, match="leave none of max_tokens"):
        llm.engine.add_request("done", PROMPTS[0], GREEDY, output_token_ids=[1] * 20)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        llm.engine.add_request("bad", PROMPTS[0], GREEDY, output_token_ids=[10**6])
    with pytest.raises(RequestRejected, match="token id None is outside the vocabulary"):
        llm.engine.add_request("none", [PROMPTS[0][0], None], GREEDY)
    assert_pool_free(llm)
