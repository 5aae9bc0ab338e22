"""Which engine takes a request: KV-aware (the prompt tokens it would compute, plus its load),
by load alone, or round-robin. Pure: the pool gathers each candidate's numbers."""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_MODES = ("kv", "load", "round-robin")
REASONS = ("prefix", "load", "imbalance", "round_robin")

# SGLang's cache-aware policy: the engine holding the largest share of the prompt's blocks takes
# it if that share reaches CACHE_THRESHOLD; otherwise the least loaded engine does. Load is
# 4 x waiting + running (vLLM's balancer's measure). A hot prefix must not draw every request to
# one engine: when the busiest candidate's load is over the idlest's by more than IMBALANCE_ABS
# and IMBALANCE_REL times it, the idlest takes the request whatever it holds.
CACHE_THRESHOLD = 0.5
IMBALANCE_ABS = 16
IMBALANCE_REL = 1.5


@dataclass(frozen=True)
class Candidate:
    load: float
    cached_blocks: int  # leading blocks of the prompt the engine holds


@dataclass(frozen=True)
class Decision:
    index: int
    reason: str  # one of REASONS


def choose(candidates: list[Candidate], routing: str, prompt_blocks: int, turn: int) -> Decision:
    """turn: a counter the caller advances per request; ties (and round-robin) rotate with it."""
    count = len(candidates)

    def rotation(index: int) -> int:
        return (index - turn) % count

    if routing == "round-robin":
        return Decision(turn % count, "round_robin")
    loads = [candidate.load for candidate in candidates]
    idlest = min(range(count), key=lambda i: (loads[i], rotation(i)))
    if routing == "load":
        return Decision(idlest, "load")
    if max(loads) - min(loads) > IMBALANCE_ABS and max(loads) > IMBALANCE_REL * min(loads):
        return Decision(idlest, "imbalance")
    best = max(range(count), key=lambda i: (candidates[i].cached_blocks, -loads[i], -rotation(i)))
    if prompt_blocks and candidates[best].cached_blocks >= CACHE_THRESHOLD * prompt_blocks:
        return Decision(best, "prefix")
    return Decision(idlest, "load")
