"""A step's schedule as the model runner's input: each scheduled sequence's chunk of tokens, with
how its sampled rows sample (constraint masks, min_tokens bans, the history penalties read) and
which prompt positions it scores."""

from __future__ import annotations

from collections.abc import Callable

from ember_core.engine.embedding import pooled_rows
from ember_core.engine.scheduler import SchedulerOutput
from ember_core.engine.sequence import Sequence
from ember_core.runner.inputs import PromptScoring, SamplingRequest, SequenceChunk
from ember_core.runner.token_masks import TokenMask, TokenMaskFiller


def step_chunks(
    decision: SchedulerOutput,
    block_tables: Callable[[int], list[list[int]]],
    token_masks: TokenMaskFiller,
    stop_token_ids: frozenset[int],
) -> list[SequenceChunk]:
    """One chunk per scheduled sequence; a chunk that reaches the sequence's end samples its last
    row, and the row after each of its drafts."""
    samples = [
        seq.num_computed_tokens + num_tokens >= seq.num_tokens and seq.params.max_tokens > 0
        for seq, num_tokens in zip(decision.seqs, decision.num_scheduled_tokens)
    ]
    constrained = [seq for seq, sampled in zip(decision.seqs, samples) if sampled and seq.matcher is not None]
    masks: dict[int, TokenMask] = {}
    if constrained:
        filled = token_masks.next_token_masks([seq.matcher for seq in constrained])
        masks = {seq.seq_id: mask for seq, mask in zip(constrained, filled)}
    chunks = []
    for seq, num_tokens, sampled in zip(decision.seqs, decision.num_scheduled_tokens, samples):
        start = seq.num_computed_tokens
        drafts = seq.drafts.token_ids if sampled else []  # the scheduler fitted them to num_tokens
        sampling: tuple[SamplingRequest, ...] = ()
        if sampled:
            mask = masks.get(seq.seq_id)
            sampling = tuple(_sampling_request(seq, drafts[:i], mask, stop_token_ids) for i in range(len(drafts) + 1))
        chunks.append(
            SequenceChunk(
                token_ids=seq.token_ids[start : start + num_tokens - len(drafts)] + drafts,
                start_position=start,
                block_tables=block_tables(seq.seq_id),
                sampling=sampling,
                scoring=_prompt_scoring(seq, start, num_tokens),
                num_prompt_tokens=seq.num_prompt_tokens,
                pooled_rows=pooled_rows(seq, start, num_tokens),
                adapter_slot=seq.adapter_slot,
                state_slot=seq.state_slot,
            )
        )
    return chunks


def _sampling_request(
    seq: Sequence, drafted: list[int], token_mask: TokenMask | None, stop_token_ids: frozenset[int]
) -> SamplingRequest:
    """How the row after seq's tokens and the drafts before it samples: as the decode at that
    output index would."""
    params = seq.params
    output_index = seq.num_output_tokens + len(drafted)
    banned: tuple[int, ...] = ()
    if output_index < params.min_tokens:
        banned = tuple(stop_token_ids | set(params.stop_token_ids or ()))
    history = params.needs_token_history
    return SamplingRequest(
        params=params,
        output_index=output_index,
        banned_token_ids=banned,
        prompt_token_ids=seq.prompt_token_ids if history else None,
        output_token_ids=seq.output_token_ids + drafted if history else None,
        token_mask=token_mask,
    )


def _prompt_scoring(seq: Sequence, start: int, num_tokens: int) -> PromptScoring | None:
    """The chunk's rows at positions p < num_prompt_tokens - 1 not scored yet score prompt token p + 1."""
    if seq.params.prompt_logprobs is None:
        return None
    first, end = max(start, len(seq.prompt_logprobs)), min(start + num_tokens, seq.num_prompt_tokens - 1)
    if first >= end:
        return None
    return PromptScoring(first - start, seq.prompt_token_ids[first + 1 : end + 1], seq.params.prompt_logprobs)
