"""The engine's counters as the wire carries them to the gateways' metrics, and each step's sample
for the dashboards."""

from __future__ import annotations

import dataclasses

from ember_core.cache.block_manager import BlockManager
from ember_core.engine.scheduler import Scheduler, SchedulerOutput
from ember_core.engine.speculator import Speculator
from ember_core.engine.state_slots import StateSlots
from ember_proto import EngineStats, StepSample


def engine_stats(
    scheduler: Scheduler,
    block_manager: BlockManager,
    speculator: Speculator | None,
    expert_tokens: list[list[int]],
    state_slots: StateSlots | None = None,
) -> EngineStats:
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_kv_blocks_used=block_manager.num_blocks - block_manager.num_free_blocks,
        num_kv_blocks_total=block_manager.num_blocks,
        num_preemptions=scheduler.num_preemptions,
        num_prefix_cache_queries=scheduler.num_prefix_queries,
        num_prefix_cache_hits=scheduler.num_prefix_hits,
        num_queued_prefill_tokens=scheduler.num_queued_prefill_tokens,
        expert_tokens=expert_tokens,
        preemptions_by_priority=dict(scheduler.preemptions_by_priority),
        **_speculation_counts(speculator),
        num_state_slots_used=0 if state_slots is None else state_slots.num_slots - state_slots.num_free_slots,
        num_state_slots_total=0 if state_slots is None else state_slots.num_slots,
    )


def _speculation_counts(speculator: Speculator | None) -> dict[str, int]:
    if speculator is None:
        return {}
    return {f"spec_{name}": value for name, value in dataclasses.asdict(speculator.counters).items()}


def step_sample(decision: SchedulerOutput, seconds: float) -> StepSample:
    """Prefill: the tokens before a sequence's last (its prompt's chunks, or its recomputation after a
    preemption); decode: each sequence's last token and its drafts."""
    prefill = sum(
        min(num_tokens, max(seq.num_tokens - 1 - seq.num_computed_tokens, 0))
        for seq, num_tokens in zip(decision.seqs, decision.num_scheduled_tokens)
    )
    total = sum(decision.num_scheduled_tokens)
    return StepSample(prefill, total - prefill, len(decision.seqs), seconds)
