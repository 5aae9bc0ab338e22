"""What the model runner is given each step: plain chunks of tokens with their block tables."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ember_core.runner.token_masks import TokenMask
from ember_core.sampling_params import SamplingParams
from ember_proto import TokenLogprob


@dataclass(frozen=True)
class SamplingRequest:
    params: SamplingParams
    output_index: int  # tokens generated so far: seeds the per-request noise, gates min_tokens
    banned_token_ids: tuple[int, ...] = ()  # EOS / stop ids while min_tokens is not reached
    # only when params.needs_token_history (penalties)
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    token_mask: TokenMask | None = None  # structured outputs: the tokens allowed next


@dataclass(frozen=True)
class PromptScoring:
    """Rows of a chunk whose next token is a prompt token to score (prompt_logprobs)."""

    first_row: int  # the chunk's row scoring next_token_ids[0]
    next_token_ids: list[int]
    num_top: int


@dataclass(frozen=True)
class SequenceChunk:
    token_ids: list[int]  # the tokens computed this step
    start_position: int  # position of token_ids[0] in its sequence
    block_tables: list[list[int]]  # one per KV cache group (the block manager's)
    # One per row of the chunk's end: its last len(sampling) rows sample. () for a prompt chunk that
    # does not reach the end; one for a decode or a prompt's last chunk; 1 + K for a decode and the K
    # draft tokens after it that the step verifies (speculative decoding).
    sampling: tuple[SamplingRequest, ...] = ()
    scoring: PromptScoring | None = None
    num_prompt_tokens: int = 0  # of the request (LongRoPE's table depends on it); 0: only positions decide
    pooled_rows: tuple[int, int] | None = None  # [first, end) rows of the chunk an embedding request sums
    adapter_slot: int = -1  # the LoRA adapter its rows run with (lora/slots.py); -1: none
    state_slot: int = -1  # a hybrid model's: the slot of its sequence's recurrent states

    @property
    def is_decode(self) -> bool:
        """Each row attends as a decode: a lone token, or a decode with its drafts (every row samples)."""
        return len(self.token_ids) == 1 or len(self.sampling) == len(self.token_ids)


@dataclass(frozen=True)
class ChunkResult:
    sampled: list[TokenLogprob]  # one per row of chunk.sampling
    prompt_logprobs: list[TokenLogprob]  # one per scored row, in order
    pooled: torch.Tensor | None = None  # the sum of the pooled_rows' final hidden states, float32


# What a tensor-parallel follower's copy of a chunk samples with: it computes the sampled rows'
# logits (for their collectives) and never samples, so only the number of rows travels.
_FOLLOWER_SAMPLING = SamplingRequest(SamplingParams(), 0)


def followers_view(chunks: list[SequenceChunk]) -> list[SequenceChunk]:
    """The chunks as tensor-parallel followers need them: their sampling requests (penalties' token
    histories, structured outputs' masks) replaced by one shared placeholder each."""
    return [replace(chunk, sampling=(_FOLLOWER_SAMPLING,) * len(chunk.sampling)) for chunk in chunks]
