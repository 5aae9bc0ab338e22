"""Continuous batching: decide, every step, which sequences run and how many tokens each computes.

Running sequences go first (oldest first), then waiting ones are admitted FIFO within the token
budget, `max_num_seqs` and the free blocks. A prompt longer than the remaining budget is computed
in chunks over several steps, beside the decodes of the running sequences. A chunk's tokens are
charged for their attention over the context before them, so at long context chunks shrink and a
step's compute stays near the budget's. With prefix caching, an admitted sequence starts from the
cached blocks of its longest cached prefix and computes the rest; blocks that a sequence scheduled
earlier in the same step completes count as cached too (every step writes its K/V before any
attention reads), so the n choices of a request, or a burst sharing a system prompt, compute the
shared prompt once.

Sliding-window layers: the block manager keeps one block table per KV cache group and drops the
blocks a window group no longer needs as a sequence advances, so every count here (fits, reserve,
admit) is of the most blocks a sequence holds at once, its prompt computed in chunks of at most
`max_num_batched_tokens` tokens. A sequence that the whole pool holds only in smaller chunks (a
window group holds its window plus one chunk) has its prompt chunks capped at that size: a
preempted sequence comes back longer than it started, and must still run alone.

The gateways route by the work a request would wait behind: `num_queued_prefill_tokens` is what the
queue still has to compute of its prompts, each waiting prompt counted at its arrival without the
prefix it found cached or queued ahead of it (a burst sharing a new system prompt computes it once).

Under the priority policy the queue is ordered by (priority, arrival), lower first, and a waiting
request that cannot start (no room in the pool or in max_num_seqs) preempts the lowest-priority
running ones, youngest first, that rank below it; memory pressure preempts by the same order. A
request that has waited `priority_aging_s` since its arrival ranks ahead of every request that has
not, in arrival order, and is never preempted for priority: no request waits much longer than that
behind higher priorities.

Static batching admits a batch only when the previous one is done. The batch stays open while
the token budget is all that stops admission (its prompts then start over several steps) and
closes once `max_num_seqs` sequences joined it, the queue is empty or the pool is full; a member
that finishes early leaves its place empty.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from ember_core.cache.block_hash import extend_block_hashes
from ember_core.cache.block_manager import BlockManager
from ember_core.config import Admission, Batching, SchedulingPolicy
from ember_core.engine.sequence import Sequence, SequenceStatus
from ember_core.engine.state_checkpoints import StateCheckpoints
from ember_proto import FinishReason


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that can never fit in the pool, finished by the scheduler itself.
    finished: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class SlotGate(Protocol):
    """Slots an admitted request takes or waits for: its LoRA adapter's (lora/slots.py), a hybrid
    model's state slot (state_slots.py)."""

    def acquire(self, seq: Sequence) -> bool: ...

    def release(self, seq: Sequence) -> None: ...


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        admission: Admission = "preempt",
        batching: Batching = "continuous",
        prefix_caching: bool = True,
        context_cost: float = 0.0,
        min_chunk_tokens: int = 1,
        policy: SchedulingPolicy = "fcfs",
        priority_aging_s: float = 60.0,
        kv_cache_dtype: str = "",
    ) -> None:
        self.block_manager = block_manager
        self.kv_cache_dtype = kv_cache_dtype  # keys the prefix cache's block hashes (cache/block_hash.py)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.admission = admission
        self.batching = batching
        self.prefix_caching = prefix_caching
        # Budget a prompt token costs per position before it (see runner/context_cost.py).
        self.context_cost = context_cost
        # The context charge shrinks no chunk below this (the budget and the prompt's rest still do).
        self.min_chunk_tokens = min_chunk_tokens
        self.policy = policy
        self.priority_aging_s = priority_aging_s
        self.waiting: deque[Sequence] = deque()
        self._static_batch_open = True
        self._static_batch_members: set[int] = set()  # seq ids admitted to the current static batch
        # Insertion-ordered: the first is the oldest, the last the youngest; O(1) removal.
        self.running: dict[int, Sequence] = {}
        self.num_reserved_blocks = 0
        self._prompt_chunk_caps: dict[int, int] = {}  # seq id -> its prompt chunks' cap, where below the budget
        self.num_preemptions = 0
        self.preemptions_by_priority: Counter[int] = Counter()
        # Prompt tokens looked up in the prefix cache at admission, and those found there.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # Prefix hashes of the unfinished sequences' prompts, and each one's estimate at arrival of
        # the prompt tokens it will compute.
        self._queued_hashes: Counter[bytes] = Counter()
        self._prefill_estimates: dict[int, tuple[int, int]] = {}  # seq id -> (tokens, hashes counted)
        self.adapters: SlotGate | None = None  # with LoRA adapters (the engine sets it)
        self.state_slots: SlotGate | None = None  # a hybrid model's (the engine sets it)
        # A hybrid model's with prefix caching: its states' checkpoints, and the copies between state
        # slots (from, to) the runner makes before the next forward (restores) or after this one (saves).
        self.state_checkpoints: StateCheckpoints | None = None
        self.state_copies: list[tuple[int, int]] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def reservation_blocks(self, seq: Sequence) -> int:
        """The most blocks a request may hold at once: prompt + max_tokens, capped by the model context."""
        max_len = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        return self.block_manager.blocks_for_sequence(max_len, self.max_num_batched_tokens)

    def check_fits(self, seq: Sequence) -> None:
        """Reject at submission what could never run, so nothing waits forever."""
        pool = self.block_manager.num_blocks
        if self.admission == "reserve":
            needed = self.reservation_blocks(seq)
            if needed > pool:
                raise ValueError(
                    f"request needs {needed} KV blocks for prompt + max_tokens but the pool has only {pool}; "
                    "lower max_tokens or enlarge the KV cache"
                )
        else:
            needed = self.block_manager.blocks_for_sequence(seq.num_prompt_tokens + 1, self.max_num_batched_tokens)
            if needed > pool:
                raise ValueError(
                    f"prompt of {seq.num_prompt_tokens} tokens needs {needed} KV blocks but the pool has only {pool}"
                )

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens the unfinished sequences have yet to compute: the waiting ones as estimated
        at their arrival, the running ones' rest."""
        waiting = sum(self._prefill_estimates[seq.seq_id][0] for seq in self.waiting)
        running = sum(seq.num_uncomputed_tokens for seq in self.running.values() if seq.num_uncomputed_tokens > 1)
        return waiting + running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        hashes = self._prompt_block_hashes(seq) if self._uses_prefix_cache(seq) else []
        hit = len(self.block_manager.cached_prefix(hashes)[0]) if hashes else 0
        while hit < len(hashes) and hashes[hit] in self._queued_hashes:
            hit += 1
        self._queued_hashes.update(hashes)
        self._prefill_estimates[seq.seq_id] = (seq.num_tokens - hit * self.block_manager.block_size, len(hashes))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.policy == "priority":
            now = time.monotonic()
            self.waiting = deque(sorted(self.waiting, key=lambda seq: self._rank(seq, now)))
            self._preempt_for_priority(out, now)
        budget = self.max_num_batched_tokens
        for seq in list(self.running.values()):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            self._fit_drafts(seq, budget)
            num_tokens, cost = self._next_chunk(seq, budget)
            if self._make_room(seq, seq.num_computed_tokens + num_tokens, out):
                self.block_manager.grow(seq.seq_id, seq.num_computed_tokens + num_tokens, seq.num_computed_tokens)
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(num_tokens)
                budget -= cost
        if out.preempted:
            return out
        if self.batching == "continuous":
            self._admit(budget, out)
        elif self._static_batch_open or not self.running:
            if not self.running:
                self._static_batch_members.clear()
            self._static_batch_open = self._admit(budget, out)
        return out

    def _rank(self, seq: Sequence, now: float) -> tuple[int, int, float, int]:
        """Lower runs first: requests aged past priority_aging_s by arrival, then the others by
        (priority, arrival)."""
        if now - seq.arrival_time >= self.priority_aging_s:
            return (0, 0, seq.arrival_time, seq.seq_id)
        return (1, seq.params.priority, seq.arrival_time, seq.seq_id)

    def _next_victim(self) -> Sequence:
        """The running sequence to preempt for memory: the youngest, or under the priority policy the
        one that ranks last."""
        if self.policy == "priority":
            now = time.monotonic()
            return max(self.running.values(), key=lambda seq: self._rank(seq, now))
        return self.running[next(reversed(self.running))]

    def _preempt_for_priority(self, out: SchedulerOutput, now: float) -> None:
        """Preempt the running sequences that rank below the first waiting one, last-ranked first,
        until it can start; never one aged past priority_aging_s."""
        no_completed_blocks: list[dict[bytes, int]] = [{} for _ in range(self.block_manager.num_groups)]
        while self.waiting:
            head = self.waiting[0]
            if len(self.running) < self.max_num_seqs and self._start_plan(head, no_completed_blocks) is not None:
                return
            victim = max(self.running.values(), key=lambda seq: self._rank(seq, now), default=None)
            if victim is None:
                return
            victim_rank = self._rank(victim, now)
            if victim_rank <= self._rank(head, now) or victim_rank[0] == 0:  # ranks ahead, or aged
                return
            self._preempt(victim)
            out.preempted.append(victim)
            self.waiting = deque(sorted(self.waiting, key=lambda seq: self._rank(seq, now)))

    def _start_plan(self, seq: Sequence, completed_in_step: list[dict[bytes, int]]) -> tuple[list[list[int]] | None, int] | None:
        """(seq's cached prefix tables, its prompt chunks' cap) when the pool can start it now, else
        None: it starts only when its whole uncomputed prompt fits, even if computed in chunks."""
        cached = self._cached_prefix(seq, completed_in_step)
        chunk_cap = self.block_manager.largest_fitting_chunk(seq.num_tokens, self.max_num_batched_tokens) or 1
        if not self.block_manager.can_start(seq.num_tokens, cached or (), chunk_tokens=chunk_cap):
            return None
        return cached, chunk_cap

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt running sequences (_next_victim) until seq can cover num_tokens; False if seq itself went."""
        while not self.block_manager.can_grow(seq.seq_id, num_tokens, seq.num_computed_tokens):
            victim = self._next_victim()
            if victim is seq and len(self.running) == 1 and not out.seqs:
                # Alone and still too big for the whole pool: it can never continue.
                self.finish(seq, FinishReason.LENGTH)
                out.finished.append(seq)
                return False
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> bool:
        """Admit waiting sequences FIFO; True if only the step's token budget stopped it."""
        # Per KV cache group: prefix hash -> block.
        completed_in_step: list[dict[bytes, int]] = [{} for _ in range(self.block_manager.num_groups)]
        if self.prefix_caching and self.waiting:
            for seq, num_tokens in zip(out.seqs, out.num_scheduled_tokens):
                self._note_completed_blocks(seq, num_tokens, completed_in_step)
        while self.waiting and self._has_room(self.waiting[0]):
            if budget <= 0:
                return True
            seq = self.waiting[0]
            if self.admission == "reserve":
                reservation = self.reservation_blocks(seq)
                if self.num_reserved_blocks + reservation > self.block_manager.num_blocks:
                    return False
            plan = self._start_plan(seq, completed_in_step)
            if plan is None:
                return False
            if seq.adapter and self.adapters is not None and not self.adapters.acquire(seq):
                return False  # every adapter slot is held: it waits its turn, at the head of the queue
            if self.state_slots is not None and not self.state_slots.acquire(seq):
                self._release_adapter(seq)
                return False
            cached, chunk_cap = plan
            self.waiting.popleft()
            if self.admission == "reserve":
                seq.reserved_blocks = reservation
                self.num_reserved_blocks += reservation
            if cached is not None:
                self.block_manager.share(seq.seq_id, cached)
                seq.num_computed_tokens = len(cached[0]) * self.block_manager.block_size
                self.num_prefix_queries += seq.num_tokens
                self.num_prefix_hits += seq.num_computed_tokens
                if self.state_checkpoints is not None and cached[0]:
                    self.state_copies.append((self.state_checkpoints.take(seq.block_hashes[len(cached[0]) - 1]), seq.state_slot))
            if chunk_cap < self.max_num_batched_tokens:
                self._prompt_chunk_caps[seq.seq_id] = chunk_cap
            num_tokens, cost = self._next_chunk(seq, budget)
            self.block_manager.grow(seq.seq_id, seq.num_computed_tokens + num_tokens, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.seq_id] = seq
            if self.batching == "static":
                self._static_batch_members.add(seq.seq_id)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(num_tokens)
            budget -= cost
            self._note_completed_blocks(seq, num_tokens, completed_in_step)
        return False

    def _has_room(self, seq: Sequence) -> bool:
        if self.batching == "static":  # a preempted member may come back
            return len(self._static_batch_members) < self.max_num_seqs or seq.seq_id in self._static_batch_members
        return len(self.running) < self.max_num_seqs

    def _note_completed_blocks(self, seq: Sequence, num_tokens: int, completed: list[dict[bytes, int]]) -> None:
        """Add to `completed` (per group: prefix hash -> block) the hashed full blocks seq completes this step."""
        if not self._uses_prefix_cache(seq):
            return
        size = self.block_manager.block_size
        end = min((seq.num_computed_tokens + num_tokens) // size, len(seq.block_hashes))
        for group_completed, table in zip(completed, self.block_manager.block_tables(seq.seq_id)):
            for index in range(seq.num_computed_tokens // size, end):
                group_completed.setdefault(seq.block_hashes[index], table[index])

    def _next_chunk(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """(tokens, budget spent) of seq's next chunk. Each token of a prompt chunk costs
        1 + context_cost x the positions computed before the chunk; a decode costs 1, so running
        streams are never pushed out by their own context."""
        if seq.num_uncomputed_tokens == 1:
            num_tokens = 1 + len(seq.drafts.token_ids)
            return num_tokens, num_tokens
        per_token = 1 + self.context_cost * seq.num_computed_tokens
        floor = min(seq.num_uncomputed_tokens, budget, self.min_chunk_tokens)
        num_tokens = max(floor, min(seq.num_uncomputed_tokens, int(budget / per_token)))
        num_tokens = min(num_tokens, self._prompt_chunk_caps.get(seq.seq_id, num_tokens))
        if self.state_checkpoints is not None and self._uses_prefix_cache(seq):
            num_tokens = self._ending_on_a_checkpoint(seq, num_tokens)
        return num_tokens, min(budget, math.ceil(num_tokens * per_token))

    def _ending_on_a_checkpoint(self, seq: Sequence, num_tokens: int) -> int:
        """A hybrid's prompt chunk cut back to end on a block boundary, where its state is
        checkpointed; its last chunk first stops at the prompt's last boundary, so a request sharing
        the whole prompt resumes there."""
        size, start = self.block_manager.block_size, seq.num_computed_tokens
        end = start + num_tokens
        boundary = (end if end < seq.num_tokens else seq.num_tokens - 1) // size * size
        return boundary - start if boundary > start else num_tokens

    def _fit_drafts(self, seq: Sequence, budget: int) -> None:
        """Cut a decode's drafts to the step's budget, and drop them unless the pool holds them with a
        block to spare per group for every running sequence: drafts never push a sequence out."""
        drafts = seq.drafts.token_ids
        del drafts[max(budget - 1, 0):]
        if not drafts:
            return
        manager = self.block_manager
        missing = manager.num_missing_blocks(seq.seq_id, seq.num_tokens + len(drafts), seq.num_computed_tokens)
        if missing + len(self.running) * manager.num_groups > manager.num_free_blocks:
            drafts.clear()

    def release_rejected_drafts(self, seq: Sequence) -> None:
        """After a verifying step: give back the blocks that only rejected drafts' positions took."""
        self.block_manager.truncate(seq.seq_id, seq.num_computed_tokens)

    def _uses_prefix_cache(self, seq: Sequence) -> bool:
        # Scoring the prompt, and pooling other than the last token's, need every prompt row computed.
        return self.prefix_caching and seq.params.prompt_logprobs is None and seq.pooling in (None, "last")

    def _cached_prefix(self, seq: Sequence, completed_in_step: list[dict[bytes, int]]) -> list[list[int]] | None:
        """Per group, the table of seq's longest prefix cached or completed in this step, leaving at
        least its last token to compute (its logits sample the next token); None when seq does not
        use the cache."""
        if not self._uses_prefix_cache(seq):
            return None
        cached = self.block_manager.cached_prefix(self._prompt_block_hashes(seq), completed_in_step)
        if self.state_checkpoints is None:
            return cached
        # A hybrid resumes only where its recurrent state was checkpointed.
        length = len(cached[0])
        while length and seq.block_hashes[length - 1] not in self.state_checkpoints:
            length -= 1
        return [table[:length] for table in cached]

    def _prompt_block_hashes(self, seq: Sequence) -> list[bytes]:
        """The prefix hashes of seq's full blocks but the one holding its last token."""
        num_blocks = (seq.num_tokens - 1) // self.block_manager.block_size
        extend_block_hashes(
            seq.block_hashes, seq.token_ids, self.block_manager.block_size, num_blocks, self.kv_cache_dtype, seq.adapter
        )
        return seq.block_hashes[:num_blocks]

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer seq's full blocks computed by now to the prefix cache (after each step it ran in)."""
        if not self._uses_prefix_cache(seq):
            return
        num_full = seq.num_computed_tokens // self.block_manager.block_size
        extend_block_hashes(
            seq.block_hashes, seq.token_ids, self.block_manager.block_size, num_full, self.kv_cache_dtype, seq.adapter
        )
        self.block_manager.offer_full_blocks(seq.seq_id, seq.block_hashes, num_full)
        if self.state_checkpoints is not None and num_full and seq.num_computed_tokens == num_full * self.block_manager.block_size:
            self._checkpoint_state(seq, seq.block_hashes[num_full - 1])

    def _checkpoint_state(self, seq: Sequence, block_hash: bytes) -> None:
        """Copy seq's states, which end on a block boundary, to a checkpoint under that block's hash;
        while it decodes, this one replaces the one it took at its previous boundary."""
        assert self.state_checkpoints is not None
        if seq.num_computed_tokens > seq.num_prompt_tokens:  # its slot goes first, never another's
            if seq.decode_checkpoint:
                self.state_checkpoints.drop(seq.decode_checkpoint)
            seq.decode_checkpoint = block_hash
        slot = self.state_checkpoints.store(block_hash)
        if slot is not None:
            self.state_copies.append((seq.state_slot, slot))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The copies between state slots the runner makes now, in order."""
        copies, self.state_copies = self.state_copies, []
        return copies

    def _preempt(self, seq: Sequence) -> None:
        """Free the KV of seq, keep its tokens, and put it at the front of the queue (recomputed later)."""
        del self.running[seq.seq_id]
        self.block_manager.free(seq.seq_id)
        self._prompt_chunk_caps.pop(seq.seq_id, None)
        self._release_slots(seq)
        seq.num_computed_tokens = 0
        seq.drafts.token_ids.clear()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preemptions_by_priority[seq.params.priority] += 1

    def _release_adapter(self, seq: Sequence) -> None:
        if self.adapters is not None:
            self.adapters.release(seq)

    def _release_slots(self, seq: Sequence) -> None:
        self._release_adapter(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Release everything seq holds, in the step it finishes."""
        if seq.status is SequenceStatus.RUNNING:
            del self.running[seq.seq_id]
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)  # only on abort; rare
        self.block_manager.free(seq.seq_id)
        self._prompt_chunk_caps.pop(seq.seq_id, None)
        self._release_slots(seq)
        _, num_hashes = self._prefill_estimates.pop(seq.seq_id)
        for block_hash in seq.block_hashes[:num_hashes]:
            self._queued_hashes[block_hash] -= 1
            if not self._queued_hashes[block_hash]:
                del self._queued_hashes[block_hash]
        self.num_reserved_blocks -= seq.reserved_blocks
        seq.reserved_blocks = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
