"""What the engine checks before a request becomes a Sequence: a request that can never run is
refused here, with the reason a client reads, rather than failing in a later step."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Any

from ember_core.config import EngineConfig
from ember_core.engine.sequence import Sequence
from ember_core.pooling import PoolingConfig, dimensions_error
from ember_core.sampling_params import SamplingParams
from ember_core.structured_outputs import ConstraintCompiler, StructuredOutputError
from ember_proto import EmbedOptions, StructuredOutputs


class RequestRejected(ValueError):
    """A request that can never run: bad token ids, too long for the context or the KV pool."""


@dataclass
class RequestIntake:
    """The engine's limits a request is checked against."""

    config: EngineConfig
    vocab_size: int
    max_model_len: int
    hidden_size: int  # the values of an embedding: the model's final hidden state's
    pooling: PoolingConfig
    constraints: ConstraintCompiler | None  # None: the model has no tokenizer

    def sequence(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        output_token_ids: Sequence_[int],
        embed: EmbedOptions | None,
    ) -> Sequence:
        """The request as a Sequence (past the tokens it generated before a resume), or RequestRejected."""
        self._check(prompt_token_ids, params, output_token_ids, embed)
        seq = Sequence(seq_id, request_id, list(prompt_token_ids), params, arrival_time)
        seq.token_ids.extend(output_token_ids)
        if embed is not None:
            seq.pooling, seq.embed_dimensions = self.pooling.method, embed.dimensions
        return seq

    def _check(
        self, prompt_token_ids: list[int], params: SamplingParams, output_token_ids: Sequence_[int],
        embed: EmbedOptions | None,
    ) -> None:
        config = self.config
        if embed is None and config.task == "embed":
            raise RequestRejected("this engine serves embeddings only (--task embed): it generates no tokens")
        if embed is not None:
            self._check_embed(embed, params)
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        if params.priority and config.scheduling_policy != "priority":
            raise RequestRejected(
                f"priority {params.priority} needs the engine's --scheduling-policy priority (it runs fcfs, where "
                "every request's priority is 0)"
            )
        vocab_size = self.vocab_size
        if bad := outside_vocabulary(itertools.chain(prompt_token_ids, output_token_ids), vocab_size):
            raise RequestRejected(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
        if len(output_token_ids) >= max(params.max_tokens, 1):
            raise RequestRejected(
                f"{len(output_token_ids)} tokens already generated leave none of max_tokens ({params.max_tokens})"
            )
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or ())):
            if bad := outside_vocabulary(ids, vocab_size):
                raise RequestRejected(f"{name} token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the model context of {self.max_model_len} tokens"
            )

    def _check_embed(self, embed: EmbedOptions, params: SamplingParams) -> None:
        if params.max_tokens != 0:
            raise RequestRejected(f"an embedding request generates no tokens: max_tokens must be 0, got {params.max_tokens}")
        if embed.dimensions is not None:
            error = dimensions_error(embed.dimensions, self.hidden_size, self.pooling.matryoshka_dimensions)
            if error is not None:
                raise RequestRejected(error)

    def matcher(self, constraint: StructuredOutputs, output_token_ids: Sequence_[int]) -> Any:
        """The constraint's matcher, past the tokens generated before a resume."""
        if self.constraints is None:
            raise RequestRejected("structured outputs need a tokenizer and this model has none")
        try:
            matcher = self.constraints.matcher(constraint)
        except StructuredOutputError as exc:
            raise RequestRejected(str(exc)) from None
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise RequestRejected(f"the tokens already generated break the constraint: {matcher.get_error()}")
        return matcher


def outside_vocabulary(token_ids: Iterable[object], vocab_size: int) -> list[object]:
    """The first id that is not an int in [0, vocab_size), as a one-item list (so that a bad None is
    told apart from no bad id); empty when every id is one."""
    return next(([t] for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), [])
