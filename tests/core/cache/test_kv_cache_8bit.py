"""An engine over an 8-bit KV cache (`kv_cache_dtype` int8 or fp8_e4m3): the pool holds ~1.9x the
blocks of a bfloat16 cache, and every cache feature keeps its promise: a token's codes depend on
that token alone, so prefix hits, chunked prefill, preemption and batching give the tokens computed
alone, bit for bit; block hashes are keyed by the cache's dtype, as the gateways compute them."""

from __future__ import annotations

import pytest

from ember_core import LLM, SamplingParams
from ember_core.cache.block_hash import prompt_block_hashes
from tests.conftest import assert_pool_free, token_prompts

QUANTIZED = ["int8", "fp8_e4m3"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
PREFIX = token_prompts(1, seed=5, min_len=40, max_len=40)[0]
PROMPTS = [PREFIX[:22] + suffix for suffix in token_prompts(8, seed=9, min_len=1, max_len=12)]


def make_llm(gpt2_dir, kv_cache_dtype: str, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_blocks", 256)
    return LLM(str(gpt2_dir), device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype, **kwargs)


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_the_same_memory_holds_1_9x_the_blocks_of_bfloat16_and_3_8x_of_float32(kv_cache_dtype: str) -> None:
    """On the default model (SmolLM2, head_dim 64): 66 bytes a token's head against 128 and 256."""
    blocks = {
        dtype: LLM(kv_cache_dtype=dtype, kv_cache_mib=8, max_model_len=64).engine.runner.num_blocks
        for dtype in ("float32", "bfloat16", kv_cache_dtype)
    }
    assert blocks[kv_cache_dtype] >= 1.9 * blocks["bfloat16"]
    assert blocks[kv_cache_dtype] >= 3.8 * blocks["float32"]


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_prefix_hits_preemption_and_batching_give_the_tokens_computed_alone(gpt2_dir, kv_cache_dtype: str) -> None:
    alone = make_llm(gpt2_dir, kv_cache_dtype, enable_prefix_caching=False)
    expected = [outputs(alone, [p])[0] for p in PROMPTS]
    # 30 blocks of 4 tokens: the prompts fit alone but not together; chunks of 7 tokens.
    llm = make_llm(gpt2_dir, kv_cache_dtype, num_blocks=30, max_num_batched_tokens=7)
    for _ in range(2):  # the second round starts from whatever the first left cached
        assert outputs(llm, PROMPTS) == expected
        assert_pool_free(llm)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hits > 0


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_sdpa_without_the_kernels_reads_the_same_codes(gpt2_dir, kv_cache_dtype: str, monkeypatch) -> None:
    """Without ember's C++ ops (another device, no compiler) the cache is quantized and read in torch
    (layers/kv_quant.py): the same codes, so the same greedy tokens."""
    from ember_core.kernels import cpu_ops

    expected = [o[0] for o in outputs(make_llm(gpt2_dir, kv_cache_dtype), PROMPTS)]
    monkeypatch.setattr(cpu_ops, "is_available", lambda: False)
    llm = make_llm(gpt2_dir, kv_cache_dtype)
    assert llm.engine.runner.decode_attention == "sdpa"
    assert [o[0] for o in outputs(llm, PROMPTS)] == expected
    assert_pool_free(llm)


def test_an_8bit_cache_stays_close_to_a_float32_one(gpt2_dir) -> None:
    """int8 moves logprobs by rounding K and V; it must not move them far (fidelity is measured on
    real models with `ember bench fidelity --kv-cache-dtype`)."""
    reference = outputs(make_llm(gpt2_dir, "auto"), PROMPTS)
    quantized = outputs(make_llm(gpt2_dir, "int8"), PROMPTS)
    first = [(tokens[0], logprobs[0]) for tokens, logprobs in reference]
    assert [tokens[0] for tokens, _ in quantized] == [token for token, _ in first]
    assert [logprobs[0] for _, logprobs in quantized] == pytest.approx([lp for _, lp in first], abs=0.05)


def test_block_hashes_are_keyed_by_the_cache_dtype(gpt2_dir) -> None:
    """The engine's prefix cache hashes a block as a gateway does for an engine of that cache dtype
    (cache/block_hash.py), and another dtype's hashes never match it."""
    prompt = PREFIX
    assert prompt_block_hashes(prompt, 4, "int8") != prompt_block_hashes(prompt, 4, "float32")
    for kv_cache_dtype, name in (("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"), ("auto", "float32")):
        llm = make_llm(gpt2_dir, kv_cache_dtype)
        assert llm.engine.kv_cache_dtype == name
        llm.engine.block_manager.take_events()  # starts recording
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        stored = llm.engine.block_manager.take_events().stored
        assert stored[: len(prompt) // 4 - 1] == prompt_block_hashes(prompt, 4, name)
