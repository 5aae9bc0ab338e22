"""Which engine takes a request: KV-aware (the least work its first token waits for and causes,
counting the prompt tokens it would compute there), by load alone, or round-robin. Pure: the pool
gathers each candidate's numbers."""

from __future__ import annotations

from dataclasses import dataclass, replace

ROUTING_MODES = ("kv", "load", "round-robin")
REASONS = ("prefix", "load", "idle", "round_robin")


@dataclass(frozen=True)
class Candidate:
    queued_tokens: int  # prompt tokens queued there to compute: as the engine reported, plus sent since
    num_waiting: int  # requests queued there: as the engine reported, plus sent since
    num_running: int  # its sequences decoding, one token a step each
    uncached_tokens: int  # of this prompt: what it would compute there
    step_token_budget: int  # tokens one of its steps computes at most
    idle: bool  # nothing running, waiting or sent since its report

    @property
    def cost(self) -> float:
        """In token computations, one unit for both, so a cached prefix and a shorter queue weigh
        against each other directly: the work the request waits behind (the queue's prompt tokens)
        and the work it causes (its own uncached tokens), which delays it and every request that
        queues behind it; under overload as many arrive while it waits as wait ahead of it now, so
        that work counts once more per request waiting. Both are scaled by the decodes that run
        meanwhile: every step gives each running sequence one token of the budget, prompts the rest."""
        budget = max(self.step_token_budget, self.num_running + 1)
        decodes = budget / (budget - self.num_running)
        return (self.queued_tokens + self.uncached_tokens * (1 + self.num_waiting)) * decodes


@dataclass(frozen=True)
class Decision:
    index: int
    reason: str  # one of REASONS


def choose(candidates: list[Candidate], routing: str, turn: int) -> Decision:
    """turn: a counter the caller advances per request; ties (and round-robin) rotate with it.

    `kv` and `load` both send the request where its cost is least; `load` leaves the cache out of
    it. The one guard is against starvation, not imbalance: when the cheapest
    engine cannot start the request in its next step while another engine sits idle, the idle one
    takes it whatever the cache says."""
    count = len(candidates)

    def rotation(index: int) -> int:
        return (index - turn) % count

    if routing == "round-robin":
        return Decision(turn % count, "round_robin")
    if routing == "load":
        candidates = [replace(candidate, uncached_tokens=0) for candidate in candidates]
    cheapest = min(range(count), key=lambda i: (candidates[i].cost, rotation(i)))
    chosen = candidates[cheapest]
    idle = [i for i in range(count) if candidates[i].idle]
    if idle and not chosen.idle and chosen.queued_tokens >= chosen.step_token_budget:
        return Decision(min(idle, key=rotation), "idle")
    if chosen.uncached_tokens < max(candidate.uncached_tokens for candidate in candidates):
        return Decision(cheapest, "prefix")
    return Decision(cheapest, "load")
