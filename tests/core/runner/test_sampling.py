"""Sampling: seeds, top-k, top-p, logprobs, min_tokens, stop tokens."""

from __future__ import annotations

import math

import pytest
import torch

from ember_core import SamplingParams
from ember_core.kernels import cpu_ops
from ember_core.runner.inputs import SamplingRequest
from ember_core.runner.sampler import _draw_with_torch, sample
from tests.conftest import assert_pool_free, token_prompts

PROMPTS = token_prompts(5, seed=31)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(gpt2_llm) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = gpt2_llm.generate([PROMPTS[0]], seeded)[0].token_ids
    again = gpt2_llm.generate([PROMPTS[0]], seeded)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 4
    batched = gpt2_llm.generate(PROMPTS, [seeded, *others])[0].token_ids
    assert alone == again == batched
    other_seed = gpt2_llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone
    assert_pool_free(gpt2_llm)


def test_top_k_1_equals_greedy(gpt2_llm) -> None:
    greedy = gpt2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    top1 = gpt2_llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_a_temperature_too_small_to_sample_with_decodes_greedily(gpt2_llm) -> None:
    greedy = gpt2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # 1 / 1e-38 overflows float32: sampling such logits gave garbage tokens
    for temperature in (1e-38, 1e-6):
        tiny = gpt2_llm.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True))
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy], temperature


def _draws(logits: list[float], params: SamplingParams, n: int) -> set[int]:
    row = torch.tensor([logits])
    return {sample(row.clone(), [SamplingRequest(params, i)])[0].token_id for i in range(n)}


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    # 0.5 < 0.7 <= 0.5 + 0.3: exactly the first two tokens
    assert _draws(logits, SamplingParams(top_p=0.7, seed=0), 300) == {0, 1}
    assert _draws(logits, SamplingParams(top_p=0.8, seed=0), 300) == {0, 1}
    assert _draws(logits, SamplingParams(top_p=0.81, seed=0), 400) == {0, 1, 2}
    assert _draws(logits, SamplingParams(top_p=0.4, seed=0), 100) == {0}
    assert _draws(logits, SamplingParams(top_p=1.0, seed=0), 2000) == {0, 1, 2, 3}


def test_top_k_limits_the_candidates() -> None:
    logits = [0.0, 0.1, 0.2, 0.3, 0.4]
    assert _draws(logits, SamplingParams(top_k=2, seed=0), 300) == {3, 4}


def test_top_k_beyond_the_vocabulary_keeps_every_token() -> None:
    """A k past the vocabulary (up to any int, which torch cannot hold) is no limit: the same draws as
    top_k=0, beside a request with a real k in the same batch. It used to fail the whole batch."""
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4]] * 2)
    def batch(k: int) -> list[int]:
        requests = [SamplingRequest(SamplingParams(top_k=k, seed=3), 0), SamplingRequest(SamplingParams(top_k=2, seed=4), 0)]
        return [s.token_id for s in sample(logits.clone(), requests)]
    for k in (5, 6, 2**31, 2**63 - 1):
        assert batch(k) == batch(0), k


def test_top_p_is_measured_on_the_top_k_tokens_renormalised() -> None:
    """As vLLM and transformers apply them: top-k first, then top-p on what it kept, rescaled to 1."""
    probs = [0.45, 0.2, 0.1, 0.09, 0.08, 0.08]
    logits = [math.log(p) for p in probs]
    # top 3: 0.45 / 0.75 = 0.6 reaches top_p 0.58 alone (over the whole vocabulary it would not)
    assert _draws(logits, SamplingParams(top_k=3, top_p=0.58, seed=0), 300) == {0}
    # 0.6 < 0.7 <= (0.45 + 0.2) / 0.75
    assert _draws(logits, SamplingParams(top_k=3, top_p=0.7, seed=0), 300) == {0, 1}
    assert _draws(logits, SamplingParams(top_k=3, top_p=1.0, seed=0), 400) == {0, 1, 2}


def test_top_p_over_a_top_k_wider_than_the_candidate_window() -> None:
    # Flat over 4000 tokens: top_k=2000 keeps the first 2000, and top_p=0.5 half of those, not of all 4000.
    logits = [-i * 1e-6 for i in range(4000)]
    draws = _draws(logits, SamplingParams(top_k=2000, top_p=0.5, seed=5), 300)
    assert 900 < max(draws) < 1010
    draws = _draws(logits, SamplingParams(top_k=2000, seed=5), 300)
    assert 1900 < max(draws) < 2000


def test_min_p_leaves_out_tokens_below_its_share_of_the_most_likely_one() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    assert _draws(logits, SamplingParams(min_p=0.5, seed=0), 300) == {0, 1}  # 0.3 >= 0.25 > 0.15
    assert _draws(logits, SamplingParams(min_p=0.3, seed=0), 400) == {0, 1, 2}  # 0.15 >= 0.15
    assert _draws(logits, SamplingParams(min_p=1.0, seed=0), 100) == {0}
    # after temperature: at T=2 the probabilities flatten, and 0.05 passes where it did not
    assert _draws(logits, SamplingParams(min_p=0.3, temperature=2.0, seed=0), 600) == {0, 1, 2, 3}
    # top-p then sees what min-p left, renormalised: 0.5 / 0.8 = 0.625 < 0.7
    assert _draws(logits, SamplingParams(min_p=0.5, top_p=0.7, seed=0), 300) == {0, 1}
    assert _draws(logits, SamplingParams(min_p=0.5, top_p=0.6, seed=0), 100) == {0}
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_min_p_applies_to_its_own_rows_of_a_batch() -> None:
    row = torch.tensor([[math.log(p) for p in (0.4, 0.35, 0.25)]])
    for i in range(200):
        batch = [SamplingRequest(SamplingParams(seed=1), i), SamplingRequest(SamplingParams(min_p=0.8, seed=1), i)]
        free, limited = sample(row.repeat(2, 1), batch)
        assert free.token_id == sample(row.clone(), batch[:1])[0].token_id
        assert limited.token_id in (0, 1)


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    row = probs.log().unsqueeze(0)
    counts = torch.zeros(3)
    for i in range(3000):
        counts[sample(row.clone(), [SamplingRequest(SamplingParams(seed=5), i)])[0].token_id] += 1
    assert (counts / counts.sum() - probs).abs().max() < 0.04


def test_logprobs_are_reported_for_the_sampled_token_and_top_n(gpt2_llm) -> None:
    out = gpt2_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token_id  # greedy picks the most likely token
        assert math.isclose(lp.logprob, lp.top_logprobs[0][1], abs_tol=1e-6)
        values = [v for _, v in lp.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0


def test_stop_token_ids_min_tokens_and_eos(gpt2_llm) -> None:
    prompt = PROMPTS[2]
    free_run = gpt2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop_at = free_run[4]
    stopped = gpt2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True))[0]
    first = free_run.index(stop_at)
    assert stopped.token_ids == free_run[: first + 1]
    assert stopped.finish_reason == "stop"
    held = gpt2_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at], min_tokens=first + 2, ignore_eos=True)
    )[0]
    assert stop_at not in held.token_ids[: first + 2]
    assert len(held.token_ids) >= first + 2
    assert_pool_free(gpt2_llm)


def test_seeded_rows_draw_the_same_tokens_in_any_batch_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    requests = [
        SamplingRequest(SamplingParams(seed=7, temperature=1.0), 3),
        SamplingRequest(SamplingParams(temperature=1.0), 0),
        SamplingRequest(SamplingParams(seed=2**62 + 5, temperature=0.7, top_p=0.9), 11),
        SamplingRequest(SamplingParams(seed=-3, temperature=1.3, top_k=50), 0),
    ]
    batched = [t.token_id for t in sample(logits.clone(), requests)]
    for row in (0, 2, 3):
        assert sample(logits[row : row + 1].clone(), [requests[row]])[0].token_id == batched[row]
    reversed_batch = sample(logits.flip(0).clone(), requests[::-1])
    assert [reversed_batch[3 - row].token_id for row in (0, 2, 3)] == [batched[row] for row in (0, 2, 3)]


def test_a_rows_draw_and_logprobs_do_not_depend_on_the_other_rows_settings() -> None:
    """Logits rounded as coarsely as bfloat16's tie often, and torch's topk and sort order ties
    differently: a row's candidates, their order and its top logprobs come from its own
    probabilities and settings, never from the wider window or longer top list another row needs."""
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 5000, generator=generator) * 4).round() / 2
    logits[1] = torch.linspace(0.0, -0.5, 5000)  # nearly flat: its nucleus reaches past the candidate window
    wide = SamplingRequest(SamplingParams(seed=1, temperature=1.0, top_p=0.99, logprobs=20), 0)
    for seed in range(30):
        requests = [
            SamplingRequest(SamplingParams(seed=seed, temperature=1.5, top_p=0.95, logprobs=2), 5),
            wide,
            SamplingRequest(SamplingParams(seed=seed, temperature=1.5, top_k=40, logprobs=3), 2),
        ]
        alone = [sample(logits[row : row + 1].clone(), [requests[row]])[0] for row in (0, 2)]
        batched = sample(logits.clone(), requests)
        assert [batched[0], batched[2]] == alone


def test_a_nucleus_wider_than_the_candidate_window_is_sampled_whole() -> None:
    # Nearly flat over 3000 tokens, most likely first: top_p=0.5 keeps about the first 1500.
    logits = [-i * 1e-4 for i in range(3000)]
    draws = _draws(logits, SamplingParams(top_p=0.5, seed=3), 300)
    assert max(draws) >= 1024  # beyond the top-1024 window that a narrow nucleus is looked up in
    assert max(draws) < 1600


def _penalized_by_hand(logits: list[float], params: SamplingParams, prompt: list[int], outputs: list[int]) -> list[float]:
    """logit_bias, then vLLM's repetition penalty and OpenAI's presence / frequency penalties, token by token."""
    adjusted = []
    for token, logit in enumerate(logits):
        logit += (params.logit_bias or {}).get(token, 0.0)
        if token in prompt or token in outputs:
            logit = logit / params.repetition_penalty if logit > 0 else logit * params.repetition_penalty
        count = outputs.count(token)
        adjusted.append(logit - params.frequency_penalty * count - params.presence_penalty * (count > 0))
    return adjusted


def test_penalties_and_logit_bias_follow_their_definitions() -> None:
    from ember_core.runner.penalties import apply_penalties_and_bias_

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, generator=generator) * 3
    cases = [
        (SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3), [1, 2, 3], [3, 5, 5, 5, 0]),
        (SamplingParams(temperature=0, logit_bias={4: 100.0, 7: -2.5}), [4], [4]),  # bias alone: no history needed
        (SamplingParams(frequency_penalty=-1.5, repetition_penalty=0.8), [9], [9, 11, 11]),
        # a bias on seen tokens: penalised together with the logit (vLLM), one pushed past zero
        (SamplingParams(repetition_penalty=2.0, logit_bias={2: 4.0, 6: -9.0}), [2], [6]),
    ]
    requests = [
        SamplingRequest(params, len(outputs), (), prompt, outputs) if params.needs_token_history else SamplingRequest(params, 0)
        for params, prompt, outputs in cases
    ]
    adjusted = logits.clone()
    apply_penalties_and_bias_(adjusted, requests)
    for row, (params, prompt, outputs) in enumerate(cases):
        assert adjusted[row].tolist() == pytest.approx(_penalized_by_hand(logits[row].tolist(), params, prompt, outputs), abs=1e-5)
    assert sample(logits.clone(), requests)[1].token_id == 4  # +100 wins the greedy row


def test_reported_logprobs_are_the_models_own_before_penalties_bias_and_bans() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0, logprobs=4, logit_bias={3: 50.0}, frequency_penalty=2.0)
    token = sample(logits.clone(), [SamplingRequest(params, 2, (1,), [0], [0, 0])])[0]
    assert token.token_id == 3
    assert token.logprob == pytest.approx(logits.log_softmax(-1)[0, 3].item())
    assert [t for t, _ in token.top_logprobs] == [0, 1, 2, 3]


def test_greedy_with_penalties_equals_a_reference_loop(gpt2_dir, gpt2_llm) -> None:
    from transformers import GPT2LMHeadModel

    reference = GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={5: 2.0})
    outputs = gpt2_llm.generate(PROMPTS[:2], params)
    for prompt, output in zip(PROMPTS[:2], outputs):
        generated: list[int] = []
        with torch.inference_mode():
            for _ in range(params.max_tokens):
                logits = reference(torch.tensor([prompt + generated])).logits[0, -1].tolist()
                adjusted = _penalized_by_hand(logits, params, prompt, generated)
                generated.append(max(range(len(adjusted)), key=adjusted.__getitem__))
        assert output.token_ids == generated
    unpenalized = gpt2_llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outputs] != [o.token_ids for o in unpenalized]  # the penalties did something here


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"), ("top_p", float("nan")),
        ("max_tokens", True), ("top_k", True), ("seed", True), ("seed", 2**63), ("seed", 1.5), ("logprobs", True),
        ("prompt_logprobs", 1.0), ("min_tokens", True), ("presence_penalty", float("nan")), ("min_p", None),
        ("repetition_penalty", "1"), ("logit_bias", {True: 1.0}), ("logit_bias", {3: float("nan")}),
        ("stop_token_ids", ["a"]), ("stop_token_ids", [-1]), ("stop_token_ids", [True]),
    ],
)
def test_bad_values_are_rejected_as_the_server_rejects_them(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_generate_rejects_stop_token_ids_outside_the_vocabulary_and_params_of_another_type(gpt2_llm) -> None:
    with pytest.raises(ValueError, match="stop_token_ids token id 10000000 is outside the vocabulary"):
        gpt2_llm.generate([[1, 2]], SamplingParams(stop_token_ids=[10**7]))
    with pytest.raises(TypeError, match="params must be a SamplingParams or a list of them, got dict"):
        gpt2_llm.generate([[1, 2], [3]], [SamplingParams(), {"n": 2}])
    with pytest.raises(TypeError, match="got generator"):
        gpt2_llm.generate([[1, 2]], (SamplingParams() for _ in range(1)))
    assert gpt2_llm.generate([[1, 2]], SamplingParams(max_tokens=2, seed=2**63 - 1))[0].finished


@pytest.mark.usefixtures("kernel")
def test_the_cpu_draw_takes_the_tokens_torchs_cumulative_sums_take() -> None:
    """cpu_ops.ops().inverse_cdf_draw against cumsum + searchsorted in float64: the same token for
    every row, also for targets that land exactly on a cumulative sum, zeros, and u at its extremes."""
    generator = torch.Generator().manual_seed(9)
    wide = (torch.randn(16, 49152, generator=generator) * 3).softmax(dim=-1)
    masked = (torch.randn(40, 37, generator=generator) * 2).softmax(dim=-1)
    masked[masked < 0.02] = 0.0  # top-k / top-p rows: zeros among the candidates, and at the end
    for probs in (wide, masked, torch.tensor([[0.0, 0.0, 1.0, 0.0]]), torch.tensor([[0.25]])):
        rows = probs.shape[0]
        cdf = probs.double().cumsum(dim=-1)
        on_a_sum = cdf.gather(1, torch.randint(0, probs.shape[1], (rows, 1), generator=generator)).squeeze(1) / cdf[:, -1]
        for uniforms in (
            torch.rand(rows, dtype=torch.float64, generator=generator),
            on_a_sum.clamp(2.0**-60, 1 - 2.0**-53),
            torch.full((rows,), 2.0**-60, dtype=torch.float64),
            torch.full((rows,), 1 - 2.0**-53, dtype=torch.float64),
        ):
            expected = _draw_with_torch(probs, uniforms)
            assert torch.equal(cpu_ops.ops().inverse_cdf_draw(probs, uniforms), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_argmaxs_token_ties_and_nan_included(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, [5, 900, 49151]] = 50.0  # a tie: the first index wins
    logits[2] = 0.0  # every token tied
    logits[3, 77] = float("nan")  # argmax takes a NaN as the maximum
    logits[4, 49151] = float("inf")
    requests = [SamplingRequest(SamplingParams(temperature=0), 0) for _ in range(6)]
    assert [token.token_id for token in sample(logits, requests)] == logits.float().argmax(dim=-1).tolist()
