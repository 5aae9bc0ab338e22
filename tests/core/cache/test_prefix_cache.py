"""Prefix caching: a prompt starts from the cached blocks of its longest prefix computed before,
with exactly the tokens and logprobs it gets without the cache, and the pool still empties."""

from __future__ import annotations

import pytest

from ember_core import LLM, SamplingParams
from ember_core.cache.block_hash import extend_block_hashes
from ember_core.cache.block_manager import BlockManager
from tests.conftest import assert_pool_free, token_prompts


def hashes_of(tokens: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, block_size, len(tokens) // block_size)
    return hashes


def test_a_block_hash_covers_every_token_before_it() -> None:
    first = hashes_of([1, 2, 3, 4], 2)
    assert len(first) == 2 and first[0] != first[1]
    assert hashes_of([9, 2, 3, 4], 2)[1] != first[1]  # same block, another prefix
    assert hashes_of([1, 2, 3, 5], 2)[0] == first[0]


def test_freed_blocks_stay_cached_until_they_are_handed_out_again() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    hashes = hashes_of(tokens, 4)
    bm.grow(1, 10)
    table = bm.block_table(1)
    bm.offer_full_blocks(1, hashes, 2)
    assert bm.cached_prefix(hashes) == [table[:2]]
    bm.free(1)
    assert bm.num_free_blocks == 8  # cached blocks no sequence holds are free
    assert bm.cached_prefix(hashes) == [table[:2]]
    assert bm.cached_prefix(hashes_of([99, *tokens[1:]], 4)) == [[]]
    assert bm.can_start(10, [table[:2]], chunk_tokens=4)
    assert not bm.can_start(8 * 4 + 1, [table[:2]], chunk_tokens=4)
    bm.share(2, [table[:2]])
    assert bm.block_table(2) == table[:2] and bm.num_free_blocks == 6
    bm.share(3, [table[:1]])
    assert bm.ref_count(table[0]) == 2 and bm.num_free_blocks == 6
    bm.free(2)
    bm.free(3)
    bm.grow(4, 8 * 4)  # every block handed out: the cached contents are gone
    assert bm.cached_prefix(hashes) == [[]]
    bm.free(4)
    assert bm.num_free_blocks == 8 and bm.cached_prefix(hashes) == [[]]


def test_a_prefix_keeps_its_first_blocks_longest() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    hashes = hashes_of([5, 6, 7, 8], 2)
    bm.grow(1, 4)
    first, second = bm.block_table(1)
    bm.offer_full_blocks(1, hashes, 2)
    bm.free(1)
    bm.grow(2, 6)  # the two never-used blocks, then the prefix's last block
    assert second in bm.block_table(2) and first not in bm.block_table(2)
    assert bm.cached_prefix(hashes) == [[first]]


def test_a_prefix_cached_already_keeps_its_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    hashes = hashes_of([5, 6], 2)
    bm.grow(1, 2)
    bm.grow(2, 2)
    first = bm.block_table(1)
    bm.offer_full_blocks(1, hashes, 1)
    bm.offer_full_blocks(2, hashes, 1)  # computed the same prefix in the same step
    assert bm.cached_prefix(hashes) == [first]
    bm.free(2)
    bm.free(1)
    assert bm.num_free_blocks == 4 and bm.cached_prefix(hashes) == [first]


def test_a_sequence_holding_blocks_cannot_start_from_the_cache() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.grow(1, 2)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        bm.share(1, [[3]])


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
PREFIX = token_prompts(1, seed=5, min_len=40, max_len=40)[0]


def make_llm(gpt2_dir, prefix_caching: bool, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 16)
    kwargs.setdefault("num_blocks", 128)
    return LLM(str(gpt2_dir), device="cpu", dtype="float32", enable_prefix_caching=prefix_caching, **kwargs)


def outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(prompts, params)]


def test_a_shared_prefix_is_computed_once_with_the_same_tokens(gpt2_dir) -> None:
    prompts = [PREFIX + [7, 8, 9], PREFIX + [10, 11], PREFIX[:35]]
    cached, uncached = make_llm(gpt2_dir, True), make_llm(gpt2_dir, False)
    with_cache, without = ([llm.generate([prompt], GREEDY)[0] for prompt in prompts] for llm in (cached, uncached))
    # The cached K/V were computed within a prompt of another length, where SDPA may sum in
    # another order: the same tokens, logprobs equal to float32 rounding.
    for a, b in zip(with_cache, without):
        assert a.token_ids == b.token_ids
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-5)
    # The second and third prompts find the first's two full blocks (32 of the 40 shared tokens).
    stats = cached.stats()
    assert (stats.num_prefix_cache_hits, stats.num_prefix_cache_queries) == (2 * 32, sum(map(len, prompts)))
    assert uncached.stats().num_prefix_cache_hits == 0
    assert_pool_free(cached)


@pytest.mark.parametrize("budget", [512, 24])  # 24: the first prompt's blocks complete over two steps
def test_prompts_admitted_in_one_step_compute_their_shared_prefix_once(gpt2_dir, budget: int) -> None:
    """Blocks the first prompt completes in a step count as cached for the prompts admitted after it
    in the same step: its K/V are written before any attention reads them."""
    prompts = [PREFIX + [7, 8, 9], PREFIX + [10, 11], PREFIX[:35]]
    cached = make_llm(gpt2_dir, True, max_num_batched_tokens=budget)
    uncached = make_llm(gpt2_dir, False, max_num_batched_tokens=budget)
    together, without = cached.generate(prompts, GREEDY), uncached.generate(prompts, GREEDY)
    for a, b in zip(together, without):
        assert a.token_ids == b.token_ids
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-5)
    assert cached.stats().num_prefix_cache_hits == 2 * 32
    assert_pool_free(cached)


def test_the_choices_of_a_request_compute_its_prompt_once(gpt2_dir) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    cached, uncached = make_llm(gpt2_dir, True), make_llm(gpt2_dir, False)
    choices = [c.token_ids for c in cached.generate([PREFIX], params)[0].outputs]
    assert choices == [c.token_ids for c in uncached.generate([PREFIX], params)[0].outputs]
    assert cached.stats().num_prefix_cache_hits == 2 * 32  # choices 1 and 2 compute only their last 8 tokens
    assert_pool_free(cached)


def test_a_repeated_prompt_computes_only_its_last_token_block(gpt2_dir) -> None:
    llm = make_llm(gpt2_dir, True, block_size=4)
    prompt = PREFIX[:32]  # whole blocks: the last one is computed again for its last token's logits
    first, second = (outputs(llm, [prompt])[0] for _ in range(2))
    assert first == second  # the same prompt: the same bits
    assert llm.stats().num_prefix_cache_hits == 28
    # Decoded tokens are cached too, so a chat's next turn starts from them. (Tokens only: K/V
    # computed in decode steps and in a prompt differ in their last bits.)
    third = llm.generate([prompt + first[0][:5]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert third.token_ids == first[0][5:]
    assert llm.stats().num_prefix_cache_hits == 28 + 36


def test_scoring_a_prompt_computes_all_of_it(gpt2_dir) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    cached, uncached = make_llm(gpt2_dir, True), make_llm(gpt2_dir, False)
    outputs(cached, [PREFIX])
    hits = cached.stats().num_prefix_cache_hits
    scored = outputs(cached, [PREFIX], params)[0]
    assert cached.stats().num_prefix_cache_hits == hits
    assert len(scored[2]) == len(PREFIX) - 1
    assert scored == outputs(uncached, [PREFIX], params)[0]


def test_shared_prefixes_under_preemption_and_eviction_give_each_prompt_its_own_tokens(gpt2_dir) -> None:
    suffixes = token_prompts(8, seed=9, min_len=1, max_len=12)
    prompts = [PREFIX[:22] + suffix for suffix in suffixes] + [PREFIX[:3] + suffixes[0]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = make_llm(gpt2_dir, False, block_size=4, num_blocks=256)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    # 30 blocks of 4 tokens: the prompts fit alone but not together.
    llm = make_llm(gpt2_dir, True, block_size=4, num_blocks=30)
    for _ in range(2):  # the second round starts from whatever the first left cached
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert_pool_free(llm)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hits > 0


def test_reset_forgets_every_cached_prefix(gpt2_dir) -> None:
    llm = make_llm(gpt2_dir, True)
    expected = outputs(llm, [PREFIX])
    llm.reset_prefix_cache()
    assert outputs(llm, [PREFIX]) == expected
    assert llm.stats().num_prefix_cache_hits == 0
