"""Which engine takes a request: KV-aware (the least time to its first token, counting the prompt
tokens it would compute there), by load alone, or round-robin. Pure: the pool gathers each
candidate's numbers."""

from __future__ import annotations

from dataclasses import dataclass, replace

ROUTING_MODES = ("kv", "load", "round-robin")
REASONS = ("prefix", "load", "idle", "round_robin")


@dataclass(frozen=True)
class Candidate:
    queued_tokens: int  # prompt tokens queued there to compute: as the engine reported, plus sent since
    num_running: int  # its sequences decoding, one token a step each
    uncached_tokens: int  # of this prompt: what it would compute there
    step_token_budget: int  # tokens one of its steps computes at most
    idle: bool  # nothing running, waiting or sent since its report

    @property
    def cost(self) -> float:
        """Token computations before the request's first token there: the queue's prompt tokens and
        its own, plus the decodes that run meanwhile, since every step gives each running sequence
        one token of the budget and the prompts the rest. One unit, so a cached prefix and a shorter
        queue weigh against each other directly."""
        prefill = self.queued_tokens + self.uncached_tokens
        budget = max(self.step_token_budget, self.num_running + 1)
        return prefill * budget / (budget - self.num_running)


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
