"""Which sequences draft tokens this step, how many, and what their verification accepted.

A step verifies a sequence's K drafts in the rows after its decode row: each row samples as the
decode at that position would (the same logits, penalties and seeded noise at the same output
index), and the drafts are kept up to the first that differs from the token sampled before it. For
greedy requests that is the argmax; for sampled ones it is rejection sampling with a one-token
draft distribution (a draft d is kept with probability p(d), else the row's own draw from p without
d follows), so the output has the distribution of decoding without drafts, and a seeded request
gives the same tokens.

A sequence stops drafting for a while when its drafts are mostly rejected (each wrong draft costs
a row of compute), for twice as long each time it happens again; and no sequence drafts in a step
that runs more than `disable_by_batch_size` sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember_core.engine.ngram_proposer import propose_ngram
from ember_core.speculative_config import SpeculativeConfig

# Below this running share of accepted drafts a sequence pauses drafting.
MIN_ACCEPTANCE = 0.3
# Output tokens of the first pause; each pause that follows a pause doubles, up to the longest.
FIRST_PAUSE_TOKENS, LONGEST_PAUSE_TOKENS = 8, 256


@dataclass
class DraftState:
    """A sequence's drafts for the coming step and how its drafts fared."""

    token_ids: list[int]
    acceptance: float = 1.0  # running share of drafts accepted, recent verifications weighing most
    paused_until: int = 0  # no drafts before the sequence has this many output tokens
    next_pause: int = FIRST_PAUSE_TOKENS


@dataclass
class SpeculationCounters:
    """vLLM's spec-decode counters since the engine started."""

    num_drafts: int = 0  # verifications: sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens the verifying steps appended: accepted drafts + the one after


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.counters = SpeculationCounters()

    def propose(self, token_ids: list[int], state: DraftState, num_output_tokens: int, room: int, batch_size: int) -> None:
        """Set state.token_ids to the sequence's drafts for the next step: at most room tokens (what its
        max_tokens and the context leave after the next one), none while it pauses or the batch is large."""
        config = self.config
        state.token_ids = []
        if batch_size > config.disable_by_batch_size or num_output_tokens < state.paused_until:
            return
        num_tokens = min(config.num_speculative_tokens, room)
        state.token_ids = propose_ngram(token_ids, num_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def record(self, state: DraftState, num_drafted: int, num_accepted: int, num_emitted: int, num_output_tokens: int) -> None:
        """Count one verification and pause the sequence's drafting when they are mostly rejected."""
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafted
        counters.num_accepted_tokens += num_accepted
        counters.num_emitted_tokens += num_emitted
        state.acceptance = 0.5 * state.acceptance + 0.5 * num_accepted / num_drafted
        if state.acceptance >= MIN_ACCEPTANCE:
            if num_accepted == num_drafted:
                state.next_pause = FIRST_PAUSE_TOKENS
            return
        state.paused_until = num_output_tokens + state.next_pause
        state.next_pause = min(2 * state.next_pause, LONGEST_PAUSE_TOKENS)
        state.acceptance = 1.0  # judged afresh after the pause
