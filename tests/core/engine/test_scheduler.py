"""Scheduler and admission policies, driven without a model."""

from __future__ import annotations

import time

import pytest

from ember_core.cache import BlockManager
from ember_core.engine.scheduler import Scheduler, SchedulerOutput
from ember_core.engine.sequence import FinishReason, Sequence, SequenceStatus
from ember_core.sampling_params import SamplingParams


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, group_windows: tuple[int | None, ...] = (None,), **kwargs
) -> Scheduler:
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", 256)
    kwargs.setdefault("max_model_len", 1024)
    return Scheduler(BlockManager(num_blocks, block_size, group_windows), **kwargs)


_next_id = iter(range(10**6))


def make_seq(prompt_len: int, max_tokens: int = 8) -> Sequence:
    seq_id = next(_next_id)
    first = 1000 * seq_id + 1  # prompts share no prefix
    return Sequence(seq_id, f"r{seq_id}", list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)


def run_step(s: Scheduler) -> SchedulerOutput:
    """What the engine does after the model ran: advance, sample a dummy token, finish at max_tokens."""
    out = s.schedule()
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                s.finish(seq, FinishReason.LENGTH)
    return out


def run_to_completion(s: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while s.num_unfinished and len(outs) < max_steps:
        outs.append(run_step(s))
    assert not s.num_unfinished
    return outs


def test_fifo_admission_within_max_num_seqs() -> None:
    s = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(4) for _ in range(3)]
    for seq in seqs:
        s.add(seq)
    out = s.schedule()
    assert out.seqs == seqs[:2]
    assert out.num_scheduled_tokens == [4, 4]
    assert list(s.waiting) == [seqs[2]]


def test_token_budget_chunks_a_long_prompt_and_decodes_go_first() -> None:
    s = make_scheduler(max_num_batched_tokens=10)
    short, long = make_seq(3), make_seq(25)
    s.add(short)
    run_step(s)  # short prefilled
    s.add(long)
    out = s.schedule()
    assert out.seqs == [short, long]
    assert out.num_scheduled_tokens == [1, 9]  # decode first, then a 9-token chunk of the prompt


def test_prompt_chunks_shrink_as_their_context_grows() -> None:
    # Each prompt token costs 1 + 0.01 per position computed before its chunk.
    s = make_scheduler(256, max_num_batched_tokens=100, context_cost=0.01)
    seq = make_seq(300)
    s.add(seq)
    chunks = [out.num_scheduled_tokens[0] for out in run_to_completion(s)]
    # At 0, 100, 150 and 190 computed positions: 100 / 1, 100 / 2, 100 / 2.5, int(100 / 2.9) tokens.
    assert chunks[:4] == [100, 50, 40, 34]
    assert sum(chunks[:-7]) == 300 and chunks[-7:] == [1] * 7  # then the 7 decodes after the first token


@pytest.mark.parametrize(
    ("first_prompt", "expected"),
    [
        # A 50-token chunk at 100 positions costs the whole budget: none left to admit.
        (300, [50]),
        # 30 tokens at 100 positions cost 60; the new prompt starts at position 0 with the other 40.
        (130, [30, 40]),
    ],
)
def test_context_cost_is_charged_against_the_budget_other_prompts_get(first_prompt: int, expected: list[int]) -> None:
    s = make_scheduler(256, max_num_batched_tokens=100, context_cost=0.01)
    first, second = make_seq(first_prompt), make_seq(300)
    s.add(first)
    run_step(s)  # its first 100 tokens
    s.add(second)
    out = s.schedule()
    assert out.seqs == [first, second][: len(expected)] and out.num_scheduled_tokens == expected


def test_decodes_cost_one_token_whatever_their_context() -> None:
    s = make_scheduler(512, max_num_batched_tokens=480, context_cost=0.01, max_num_seqs=8)
    seqs = [make_seq(60, max_tokens=100) for _ in range(8)]
    for seq in seqs:
        s.add(seq)
    run_step(s)  # all 8 prompts at position 0, 60 tokens each
    s.max_num_batched_tokens = 8
    out = s.schedule()
    # Past 60 positions a prompt token costs 1.6; a decode costs 1, so all 8 fit a budget of 8.
    assert out.seqs == seqs and out.num_scheduled_tokens == [1] * 8


def test_a_prompt_chunk_gets_one_token_when_its_context_outweighs_what_is_left() -> None:
    s = make_scheduler(max_num_batched_tokens=4, context_cost=0.5, max_num_seqs=2)
    seq = make_seq(12)
    s.add(seq)
    chunks = [out.num_scheduled_tokens[0] for out in run_to_completion(s)]
    # 4 tokens at position 0, then every token of the rest costs more than the budget: one per step.
    assert chunks[0] == 4 and chunks[1:9] == [1] * 8


def test_the_context_charge_shrinks_no_chunk_below_the_minimum() -> None:
    s = make_scheduler(256, max_num_batched_tokens=100, context_cost=0.01, min_chunk_tokens=60)
    seq = make_seq(300)
    s.add(seq)
    chunks = [out.num_scheduled_tokens[0] for out in run_to_completion(s)]
    # 100, then 50 by the charge alone, raised to 60; the rest of the prompt, 20, is below the minimum.
    assert chunks[:5] == [100, 60, 60, 60, 20]


def test_admission_stops_when_the_whole_prompt_does_not_fit_in_free_blocks() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    first, second = make_seq(12), make_seq(8)
    s.add(first)
    s.add(second)
    out = s.schedule()
    assert out.seqs == [first]  # 3 blocks used, 1 free: the 2-block prompt waits
    assert list(s.waiting) == [second]


def test_finished_sequence_frees_blocks_and_a_waiting_one_runs_next_step() -> None:
    s = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=1)
    a, b = make_seq(4, max_tokens=1), make_seq(4, max_tokens=1)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.status is SequenceStatus.FINISHED
    assert s.block_manager.num_free_blocks == 3
    assert s.schedule().seqs == [b]


def test_youngest_running_sequence_is_preempted_and_keeps_its_place() -> None:
    s = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=4)
    old, young = make_seq(4, max_tokens=20), make_seq(3, max_tokens=20)
    s.add(old)
    s.add(young)
    run_step(s)  # old holds 2 blocks, young 2 blocks (3 tokens): pool full
    assert s.block_manager.num_free_blocks == 0
    out = s.schedule()  # old needs a third block for its 6th token
    assert out.preempted == [young]
    assert out.seqs == [old]
    assert young.status is SequenceStatus.WAITING and young.num_computed_tokens == 0
    assert s.waiting[0] is young
    assert young.num_tokens == 4  # prompt + the token it generated: kept for recompute
    assert s.num_preemptions == 1


def test_preempted_sequences_return_to_the_front_in_their_original_order() -> None:
    s = make_scheduler(num_blocks=6, block_size=2, max_num_seqs=4)
    a, b, c = make_seq(3, max_tokens=30), make_seq(3, max_tokens=30), make_seq(3, max_tokens=30)
    late = make_seq(2)
    for seq in (a, b, c):
        s.add(seq)
    run_step(s)
    s.add(late)
    while not s.num_preemptions:
        run_step(s)
    order = list(s.waiting)
    assert order.index(c) < order.index(late)
    if b in order:
        assert order.index(b) < order.index(c)


def test_preempt_policy_finishes_every_sequence_with_a_squeezed_pool() -> None:
    s = make_scheduler(num_blocks=10, block_size=2, max_num_seqs=8)
    seqs = [make_seq(5, max_tokens=12) for _ in range(6)]
    for seq in seqs:
        s.add(seq)
    run_to_completion(s)
    assert s.num_preemptions > 0
    assert all(seq.num_output_tokens == 12 for seq in seqs)
    assert s.block_manager.num_free_blocks == 10


def test_reserve_admission_never_preempts_and_respects_reservations() -> None:
    s = make_scheduler(num_blocks=10, block_size=2, admission="reserve")
    seqs = [make_seq(4, max_tokens=6) for _ in range(4)]  # 5 blocks each
    for seq in seqs:
        s.add(seq)
    out = s.schedule()
    assert out.seqs == seqs[:2]
    assert s.num_reserved_blocks == 10
    run_to_completion(s)
    assert s.num_preemptions == 0
    assert s.num_reserved_blocks == 0
    assert s.block_manager.num_free_blocks == 10


def test_reserve_releases_the_reservation_of_a_request_that_finishes_early() -> None:
    s = make_scheduler(num_blocks=10, block_size=2, admission="reserve")
    a, b = make_seq(4, max_tokens=6), make_seq(4, max_tokens=6)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a, FinishReason.STOP)
    assert s.num_reserved_blocks == 5
    c = make_seq(4, max_tokens=6)
    s.add(c)
    assert c in s.schedule().seqs


def test_reserve_rejects_a_request_larger_than_the_pool() -> None:
    s = make_scheduler(num_blocks=4, block_size=2, admission="reserve")
    with pytest.raises(ValueError, match="KV blocks"):
        s.check_fits(make_seq(4, max_tokens=6))


def test_preempt_rejects_a_prompt_larger_than_the_pool() -> None:
    s = make_scheduler(num_blocks=2, block_size=2)
    s.check_fits(make_seq(3, max_tokens=100))
    with pytest.raises(ValueError, match="KV blocks"):
        s.check_fits(make_seq(4))


def test_a_lone_sequence_outgrowing_the_pool_finishes_with_length() -> None:
    s = make_scheduler(num_blocks=2, block_size=2)
    seq = make_seq(3, max_tokens=10)
    s.add(seq)
    run_to_completion(s)
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_tokens == 5  # the 5th token was sampled from a full pool; its K/V had no room
    assert s.block_manager.num_free_blocks == 2


def test_static_batching_admits_only_when_the_batch_is_done() -> None:
    s = make_scheduler(batching="static", max_num_seqs=2)
    a, b, c = make_seq(3, max_tokens=1), make_seq(3, max_tokens=4), make_seq(3, max_tokens=1)
    for seq in (a, b, c):
        s.add(seq)
    run_step(s)  # a finishes at once, b still running
    assert a.is_finished
    out = run_step(s)
    assert out.seqs == [b]  # c waits although a slot is free
    run_to_completion(s)
    assert c.is_finished


def test_a_static_batch_fills_up_over_several_steps_when_the_token_budget_is_short() -> None:
    s = make_scheduler(batching="static", max_num_seqs=3, max_num_batched_tokens=8)
    a, b, c, late = make_seq(6, max_tokens=20), make_seq(6, max_tokens=20), make_seq(6, max_tokens=2), make_seq(3)
    for seq in (a, b, c):
        s.add(seq)
    assert run_step(s).seqs == [a, b]  # the budget ends inside b's prompt
    assert run_step(s).seqs == [a, b, c]  # the batch is still open: c joins
    s.add(late)
    for _ in range(5):
        assert late not in run_step(s).seqs  # c finished, but the batch closed when it was full
    run_to_completion(s)
    assert late.is_finished


def test_a_static_batch_leaves_the_place_of_a_member_that_finished_empty() -> None:
    s = make_scheduler(batching="static", max_num_seqs=3, max_num_batched_tokens=6)
    a, b, c, d = make_seq(5, max_tokens=1), make_seq(5, max_tokens=10), make_seq(2, max_tokens=10), make_seq(3)
    for seq in (a, b, c, d):
        s.add(seq)
    assert run_step(s).seqs == [a, b]  # the budget ends inside b's prompt: the batch stays open
    assert a.is_finished
    assert run_step(s).seqs == [b, c]  # c is the third member
    for _ in range(5):
        assert d not in run_step(s).seqs  # a's place stays empty until the batch is done
    run_to_completion(s)
    assert d.is_finished


def test_a_static_batch_closes_when_the_queue_is_empty() -> None:
    s = make_scheduler(batching="static", max_num_seqs=4)
    a, late = make_seq(3, max_tokens=5), make_seq(3)
    s.add(a)
    run_step(s)
    s.add(late)
    assert run_step(s).seqs == [a]


def test_continuous_batching_fills_a_free_slot_in_the_next_step() -> None:
    s = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq(3, max_tokens=1), make_seq(3, max_tokens=4), make_seq(3, max_tokens=1)
    for seq in (a, b, c):
        s.add(seq)
    run_step(s)
    assert a.is_finished
    out = s.schedule()
    assert out.seqs == [b, c]


def test_abort_of_a_waiting_sequence_removes_it() -> None:
    s = make_scheduler(max_num_seqs=1)
    a, b = make_seq(3), make_seq(3)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b, FinishReason.ABORT)
    s.finish(a, FinishReason.ABORT)
    assert not s.num_unfinished
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_queued_prefill_tokens_count_a_prefix_shared_in_the_queue_once() -> None:
    s = make_scheduler(prefix_caching=True)
    shared = list(range(1, 41))  # ten blocks of 4

    def tenant_seq(user: int) -> Sequence:
        seq_id = next(_next_id)
        prompt = shared + [100 * user + i for i in range(6)]
        return Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=2), 0.0)

    for user in range(3):
        s.add(tenant_seq(user))
    assert s.num_queued_prefill_tokens == 46 + 6 + 6  # the first computes the shared blocks
    run_step(s)
    assert s.num_queued_prefill_tokens == 0  # all admitted in one step, now decoding
    for seq in s.running.values():
        s.cache_computed_blocks(seq)  # as the engine does after a step
    run_to_completion(s)
    s.add(tenant_seq(3))
    assert s.num_queued_prefill_tokens == 6  # the pool's cache holds the shared blocks now
    s.add(make_seq(10))
    assert s.num_queued_prefill_tokens == 16
    without_cache = make_scheduler(prefix_caching=False)
    for user in range(2):
        without_cache.add(tenant_seq(user))
    assert without_cache.num_queued_prefill_tokens == 92


def make_prioritized(prompt_len: int, priority: int, waited_s: float = 0.0, max_tokens: int = 8) -> Sequence:
    seq = make_seq(prompt_len, max_tokens)
    seq.params = SamplingParams(max_tokens=max_tokens, priority=priority)
    seq.arrival_time = time.monotonic() - waited_s
    return seq


def test_priority_orders_the_queue_by_priority_then_arrival() -> None:
    s = make_scheduler(max_num_seqs=1, policy="priority")
    low, high, high_later = make_prioritized(4, 5), make_prioritized(4, -1), make_prioritized(4, -1)
    for seq in (low, high, high_later):
        s.add(seq)
    assert s.schedule().seqs == [high]
    assert list(s.waiting) == [high_later, low]


def _full_pool(policy: str, priorities: tuple[int, int]) -> tuple[Scheduler, list[Sequence]]:
    """4 blocks of 4, two running 7-token prompts that decode within their 2 blocks each: full."""
    s = make_scheduler(num_blocks=4, policy=policy)
    running = [make_prioritized(7, priority, max_tokens=2) for priority in priorities]
    for seq in running:
        s.add(seq)
    assert run_step(s).seqs == running and s.block_manager.num_free_blocks == 0
    return s, running


def test_a_higher_priority_arrival_preempts_the_lowest_priority_running_one() -> None:
    s, (_low, lower) = _full_pool("priority", (1, 2))
    urgent = make_prioritized(7, 0, max_tokens=2)
    s.add(urgent)
    out = run_step(s)
    assert out.preempted == [lower] and lower.status is SequenceStatus.WAITING
    assert s.preemptions_by_priority == {2: 1}
    assert urgent in run_step(s).seqs
    run_to_completion(s)
    assert s.block_manager.num_free_blocks == 4


def test_an_equal_priority_or_fcfs_does_not_preempt_for_priority() -> None:
    for policy, newcomer in (("priority", 1), ("fcfs", 0)):
        s, _ = _full_pool(policy, (1, 1))
        s.add(make_prioritized(7, newcomer, max_tokens=2))
        assert run_step(s).preempted == []


def test_aging_bounds_the_wait_of_a_low_priority_request() -> None:
    """Waited past priority_aging_s, it ranks ahead of fresh higher priorities, and is not preempted for them."""
    s = make_scheduler(max_num_seqs=1, policy="priority", priority_aging_s=30.0)
    starved, fresh = make_prioritized(4, 100, waited_s=31.0), make_prioritized(4, 0)
    s.add(fresh)
    s.add(starved)
    assert s.schedule().seqs == [starved]
    s.add(make_prioritized(4, -100))
    assert s.schedule().preempted == [] and starved.status is SequenceStatus.RUNNING
    young = make_scheduler(max_num_seqs=1, policy="priority", priority_aging_s=30.0)
    waiting, urgent = make_prioritized(4, 100, waited_s=29.0), make_prioritized(4, 0)
    young.add(waiting)
    young.add(urgent)
    assert young.schedule().seqs == [urgent]
