"""n-gram speculative decoding: the same tokens as decoding without it (greedy and seeded, alone and
in any batch), the distribution of unseeded sampling kept, rejected drafts' blocks given back and
never cached, and the drafting switched off where it does not pay."""

from __future__ import annotations

import math

import pytest
import torch

from ember_core import LLM, SamplingParams
from ember_core.config import EngineConfig
from ember_core.engine.ngram_proposer import propose_ngram
from ember_core.engine.speculator import FIRST_PAUSE_TOKENS, DraftState, Speculator
from ember_core.speculative_config import SpeculativeConfig
from tests.conftest import assert_pool_free, token_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Drafts in every step, however large the batch, so that the tests verify drafts in batches.
ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
          "disable_by_batch_size": 1000}
COPY_TEXT = (
    "Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly. Pack my box with five "
    "dozen liquor jugs. How vexingly quick daft zebras jump."
)


def repeating_prompts(count: int, seed: int) -> list[list[int]]:
    """Random token prompts that repeat their first part: material for prompt lookup."""
    return [p + p[: len(p) // 2] for p in token_prompts(count, seed=seed, min_len=8, max_len=40)]


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_blocks", 512)
    return LLM(str(model_dir), device="cpu", dtype="float32", **kwargs)


def spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.stats()
    return stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


@pytest.fixture(scope="module")
def smollm(smollm2_gguf_path) -> LLM:
    return LLM(str(smollm2_gguf_path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def smollm_spec(smollm2_gguf_path) -> LLM:
    return LLM(str(smollm2_gguf_path), device="cpu", dtype="float32", speculative_config=ALWAYS)


def copy_prompts(llm: LLM) -> list[str]:
    asks = ["Repeat this text exactly", "Correct the spelling of this text", "Summarise this text in one line"]
    return [llm.tokenizer.render_chat([{"role": "user", "content": f"{ask}:\n\n{COPY_TEXT}"}]) for ask in asks]


def test_a_real_model_copying_gives_the_same_greedy_tokens_and_logprobs(smollm, smollm_spec) -> None:
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    prompts = copy_prompts(smollm)
    alone = [smollm.generate([p], params)[0].token_ids for p in prompts]
    drafted_before, accepted_before = spec_counts(smollm_spec)
    batched = smollm_spec.generate(prompts, params)
    assert [o.token_ids for o in batched] == alone
    # the same batch decoded without drafts (its prompts computed as in the run with them, not from
    # the cache): the same bits, logprobs included
    smollm.reset_prefix_cache()
    for plain, spec in zip(smollm.generate(prompts, params), batched):
        assert spec.logprobs == plain.logprobs
        assert spec.finish_reason == plain.finish_reason
    drafted, accepted = spec_counts(smollm_spec)
    assert accepted - accepted_before > 0.8 * (drafted - drafted_before) > 48  # copying: most drafts are accepted
    assert_pool_free(smollm_spec)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_greedy_tokens_equal_decoding_without_drafts_in_a_batch(gpt2_dir, block_size) -> None:
    prompts = repeating_prompts(6, seed=5)
    plain = make_llm(gpt2_dir, block_size=block_size, num_blocks=2048 // block_size)
    expected = [plain.generate([p], GREEDY)[0].token_ids for p in prompts]
    spec = make_llm(gpt2_dir, block_size=block_size, num_blocks=2048 // block_size, speculative_config=ALWAYS)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == expected
    assert spec_counts(spec)[1] > 0
    assert_pool_free(spec)


def test_a_squeezed_pool_preempts_and_still_gives_the_same_tokens(gpt2_dir) -> None:
    prompts = repeating_prompts(6, seed=6)
    expected = [make_llm(gpt2_dir).generate([p], GREEDY)[0].token_ids for p in prompts]
    spec = make_llm(gpt2_dir, num_blocks=24, speculative_config=ALWAYS)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == expected
    assert spec.stats().num_preemptions > 0
    assert_pool_free(spec)


def test_stops_max_tokens_and_min_tokens_end_where_they_end_without_drafts(gpt2_dir) -> None:
    prompts = repeating_prompts(4, seed=7)
    plain, spec = make_llm(gpt2_dir), make_llm(gpt2_dir, speculative_config=ALWAYS)
    first = plain.generate([prompts[0]], GREEDY)[0].token_ids
    cases = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first[6]]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first[2]], min_tokens=9),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    for params in cases:
        expected = [plain.generate([p], params)[0] for p in prompts]
        got = spec.generate(prompts, params)
        assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
    assert_pool_free(spec)


def test_seeded_sampling_gives_the_same_tokens(gpt2_dir) -> None:
    prompts = repeating_prompts(5, seed=8)
    params = [SamplingParams(temperature=0.7, top_k=4, max_tokens=24, seed=100 + i, ignore_eos=True) for i in range(5)]
    expected = [make_llm(gpt2_dir).generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    spec = make_llm(gpt2_dir, speculative_config=ALWAYS)
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted


def test_rejected_drafts_leave_no_block_and_no_cached_prefix_behind(gpt2_dir) -> None:
    """After every step a sequence holds the blocks its tokens need, no more; and the prefix cache ends
    up holding exactly the blocks decoding without drafts caches."""
    prompts = repeating_prompts(3, seed=9)
    spec = make_llm(gpt2_dir, block_size=1, num_blocks=1024, speculative_config=ALWAYS)
    engine = spec.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running.values():
            assert len(engine.block_manager.block_table(seq.seq_id)) == seq.num_computed_tokens
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted
    plain = make_llm(gpt2_dir, block_size=1, num_blocks=1024)
    plain.generate(prompts, GREEDY)
    assert sorted(engine.block_manager.cached_hashes()) == sorted(plain.engine.block_manager.cached_hashes())
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert_pool_free(spec)


def test_unseeded_sampling_keeps_the_distribution(gpt2_dir) -> None:
    """The first three tokens' joint frequencies over 3000 draws with drafts, against the model's own
    distribution (chi-square, df 7, p = 0.001). logit_bias confines every token to two that the
    prompt's tail is made of, so drafts always exist and are accepted sometimes, not always."""
    head = token_prompts(1, seed=10, min_len=12, max_len=12)[0]
    a, b = head[0], head[1]
    prompt = head + [a, b, b, a, a, a, b, b, b, a, b]
    plain = make_llm(gpt2_dir)

    def own_logprob(prefix: list[int], token: int) -> float:
        forced = SamplingParams(temperature=0, max_tokens=1, logprobs=0, logit_bias={token: 100})
        return plain.generate([prefix], forced)[0].logprobs[0].logprob

    def pair(prefix: list[int]) -> dict[int, float]:
        p_a = 1 / (1 + math.exp(own_logprob(prefix, b) - own_logprob(prefix, a)))
        return {a: p_a, b: 1 - p_a}

    expected = {
        (x, y, z): px * py * pz
        for x, px in pair(prompt).items()
        for y, py in pair(prompt + [x]).items()
        for z, pz in pair(prompt + [x, y]).items()
    }
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logit_bias={a: 100, b: 100})
    spec = make_llm(gpt2_dir, num_blocks=2048, speculative_config=ALWAYS)
    torch.manual_seed(0)
    draws = 3000
    counts = dict.fromkeys(expected, 0)
    for output in spec.generate([prompt] * draws, params):
        counts[tuple(output.token_ids)] += 1
    chi_square = sum((counts[cell] - draws * p) ** 2 / (draws * p) for cell, p in expected.items())
    assert chi_square < 24.32, (chi_square, counts, expected)
    drafted, accepted = spec_counts(spec)
    assert 0.1 * drafted < accepted < 0.9 * drafted


def test_drafting_is_off_above_the_batch_size_and_pauses_when_rejected() -> None:
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=2))
    state = DraftState([])
    tokens = [5, 6, 7, 8, 5, 6]
    speculator.propose(tokens, state, num_output_tokens=1, room=10, batch_size=3)
    assert state.token_ids == []
    speculator.propose(tokens, state, num_output_tokens=1, room=2, batch_size=2)
    assert state.token_ids == [7, 8]  # what followed "5 6", cut to the room left
    speculator.record(state, num_drafted=2, num_accepted=0, num_emitted=1, num_output_tokens=2)
    speculator.record(state, num_drafted=2, num_accepted=0, num_emitted=1, num_output_tokens=3)
    assert state.paused_until == 3 + FIRST_PAUSE_TOKENS
    speculator.propose(tokens, state, num_output_tokens=3 + FIRST_PAUSE_TOKENS - 1, room=10, batch_size=1)
    assert state.token_ids == []
    speculator.propose(tokens, state, num_output_tokens=3 + FIRST_PAUSE_TOKENS, room=10, batch_size=1)
    assert state.token_ids == [7, 8, 5]
    speculator.record(state, num_drafted=3, num_accepted=0, num_emitted=1, num_output_tokens=20)
    speculator.record(state, num_drafted=3, num_accepted=0, num_emitted=1, num_output_tokens=21)
    assert state.paused_until == 21 + 2 * FIRST_PAUSE_TOKENS  # a second pause lasts twice as long
    counters = speculator.counters
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (4, 10, 0)


def test_a_model_whose_drafts_all_fail_drafts_little(gpt2_dir) -> None:
    # Random prompts without repeats: what lookup finds is rarely what the model writes next.
    prompts = token_prompts(4, seed=11, min_len=30, max_len=40)
    spec = make_llm(gpt2_dir, speculative_config={**ALWAYS, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=3)
    spec.generate(prompts, params)
    stats = spec.stats()
    assert stats.spec_num_drafts < 0.5 * 4 * 60


def test_prompt_lookup_takes_the_longest_suffix_seen_before_and_its_latest_occurrence() -> None:
    assert propose_ngram([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2, 1, 3) == [9, 2]  # "1 2 3" beats the later "2 3"
    assert propose_ngram([2, 3, 7, 2, 3, 8, 2, 3], 3, 1, 2) == [8, 2, 3]  # the latest "2 3"
    assert propose_ngram([1, 2, 3, 4], 3, 1, 2) == []
    assert propose_ngram([256, 1, 0, 0, 1], 2, 1, 2) == [0, 0]  # byte matches across token boundaries do not count
    assert propose_ngram([4, 4], 3, 2, 2) == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "eagle"}', "method must be 'ngram'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "exceeds prompt_lookup_max"),
        ('{"method": "ngram", "lookahead": 2}', "unknown key(s) lookahead"),
        ('{"num_speculative_tokens": 2}', 'needs "method": "ngram"'),
        ("ngram", "is not JSON"),
    ],
)
def test_bad_configs_are_refused_with_what_is_wrong(value: str, message: str) -> None:
    with pytest.raises(ValueError, match="speculative_config") as error:
        EngineConfig(speculative_config=value)
    assert message in str(error.value)
