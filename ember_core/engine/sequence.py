"""A request as the engine sees it: token ids, sampling params, progress and finish state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ember_core.engine.speculator import DraftState
from ember_core.pooling import Pooling
from ember_core.sampling_params import SamplingParams
from ember_proto import FinishReason, TokenLogprob


class SequenceStatus(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    token_ids: list[int] = field(init=False)
    # Tokens whose K/V are in the cache; everything after them is computed in later steps.
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    reserved_blocks: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # of prompt tokens 1, 2, ... as they are scored (params.prompt_logprobs); a recompute after
    # preemption does not score them again
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # prefix hashes of its leading full blocks (prefix caching), computed as they are needed
    block_hashes: list[bytes] = field(default_factory=list)
    # llguidance's matcher of params.structured_outputs: what may come next, fed every token sampled
    matcher: Any = None
    # speculative decoding: the drafts the next step verifies after its decode, and how drafts fared
    drafts: DraftState = field(default_factory=lambda: DraftState([]))
    # An embedding request: how its prompt's final hidden states pool, its `dimensions`, and the
    # pooled state of the chunks computed so far (a sum for mean pooling), a float32 tensor.
    pooling: Pooling | None = None
    embed_dimensions: int | None = None
    pooled: Any = None
    # A LoRA adapter the request runs with: its name (which keys its prefix hashes) and slot
    adapter: str = ""
    adapter_slot: int = -1
    # A hybrid model's state slot while it runs (engine/state_slots.py); -1: none
    state_slot: int = -1
    # the prefix hash of its latest state checkpoint taken while decoding (engine/state_checkpoints.py)
    decode_checkpoint: bytes = b""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
