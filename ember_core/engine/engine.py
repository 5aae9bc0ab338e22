"""The engine: tokens in, tokens out. Intake validation, then a step loop of
schedule -> run the model -> update sequences -> collect finished."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from typing import Any

import torch

from ember_core.cache.block_manager import BlockManager
from ember_core.config import EngineConfig
from ember_core.device import available_memory, resolve_device
from ember_core.engine.embedding import add_pooled, embedding_bytes, pooled_rows
from ember_core.engine.scheduler import Scheduler, SchedulerOutput
from ember_core.engine.sequence import Sequence
from ember_core.engine.speculator import Speculator
from ember_core.layers.kv_quant import kv_cache_dtype, kv_cache_dtype_name
from ember_core.layers.linear import SMALL_BATCH_ROWS
from ember_core.layers.moe import routed_tokens_by_layer
from ember_core.loaders import LoadedModel, load_model
from ember_core.pooling import dimensions_error
from ember_core.runner.context_cost import context_cost_per_position
from ember_core.runner.dtype_probe import dtype_for_model
from ember_core.runner.inputs import PromptScoring, SamplingRequest, SequenceChunk
from ember_core.runner.kv_cache_layout import kv_cache_layout
from ember_core.runner.model_runner import ModelRunner
from ember_core.runner.token_masks import TokenMask, TokenMaskFiller
from ember_core.sampling_params import SamplingParams
from ember_core.structured_outputs import ConstraintCompiler, StructuredOutputError
from ember_proto import (
    BLOCK_MAP_STEPS,
    EmbedOptions,
    EngineStats,
    FinishReason,
    RequestDelta,
    StepSample,
    TokenLogprob,
)

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run: bad token ids, too long for the context or the KV pool."""


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        device = resolve_device(config.device)
        self.loaded = loaded or load_model(
            config.model, device, dtype_for_model(config.dtype, device), compact_weights=config.gguf_weights == "blocks",
            numerics=config.numerics,
        )
        model, dtype = self.loaded.model, self.loaded.dtype
        num_blocks = config.num_blocks
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, device)
        self.kv_cache_dtype = kv_cache_dtype_name(kv_dtype)  # what the engine reports, and its hashes' key
        layout = kv_cache_layout(model)
        bytes_per_block = layout.bytes_per_block(config.block_size, kv_dtype)
        if num_blocks is None:
            num_blocks = int(config.kv_cache_mib * 2**20) // bytes_per_block
            if num_blocks == 0:
                raise ValueError(
                    f"a KV cache of {config.kv_cache_mib:g} MiB holds no block of {config.block_size} tokens "
                    f"({bytes_per_block / 2**20:.1f} MiB each): raise --kv-cache-mib or lower --block-size"
                )
        _check_kv_cache_fits(num_blocks * bytes_per_block, device)
        self.kv_cache_bytes = num_blocks * bytes_per_block
        self.block_manager = BlockManager(num_blocks, config.block_size, layout.group_windows)
        cache_tokens = self.block_manager.longest_fitting_sequence(self.loaded.max_model_len, config.max_num_batched_tokens)
        logger.info(
            "KV cache: %d blocks x %d tokens in %d group(s) of %d layers (%.1f MiB, %s): one sequence may hold %d tokens",
            num_blocks, config.block_size, len(layout.group_windows), layout.layers_per_group,
            num_blocks * bytes_per_block / 2**20, kv_dtype, cache_tokens,
        )
        self.max_model_len = _max_model_len(self.loaded.max_model_len, config.max_model_len, cache_tokens)
        if config.max_num_seqs > config.max_num_batched_tokens:
            logger.warning(
                "max_num_seqs %d > max_num_batched_tokens %d: every running sequence takes at least one token "
                "of a step, so at most %d run at once",
                config.max_num_seqs, config.max_num_batched_tokens, config.max_num_batched_tokens,
            )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            admission=config.admission,
            batching=config.batching,
            prefix_caching=config.enable_prefix_caching,
            context_cost=context_cost_per_position(model),
            # Every step streams all the weights from memory: at long context the charge would cut a
            # prompt into chunks of a few tokens, each paying that for little work.
            min_chunk_tokens=SMALL_BATCH_ROWS + 1,
            policy=config.scheduling_policy,
            priority_aging_s=config.priority_aging_s,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        self.runner = ModelRunner(model, num_blocks, config.block_size, kv_dtype, config.decode_attention)
        self.stop_token_ids = self.loaded.stop_token_ids
        tokenizer = self.loaded.tokenizer
        self._constraints = None if tokenizer is None else ConstraintCompiler(
            tokenizer, self.loaded.vocab_size, sorted(self.stop_token_ids)
        )
        self._token_masks = TokenMaskFiller(self.loaded.vocab_size)
        spec = config.speculative_config
        self.speculator = None if spec is None else Speculator(spec)
        self._sequences: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._aborted: list[RequestDelta] = []
        # Sees each step's schedule before the step runs (the engine worker's tracing, when on).
        self.schedule_observer: Callable[[SchedulerOutput], None] | None = None
        self.step_samples: deque[StepSample] = deque(maxlen=BLOCK_MAP_STEPS)  # for dashboards

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_token_ids: list[int] | tuple[int, ...] = (),
        embed: EmbedOptions | None = None,
    ) -> None:
        """output_token_ids: what the request already generated on an engine that was lost. It
        continues after them as if it had never stopped: they count toward max_tokens, min_tokens and
        the penalties, and a seeded request samples the same tokens it would have. params.priority:
        lower runs first under the priority scheduling policy; under fcfs only 0 is taken (as vLLM).
        embed: the request wants its prompt's pooled embedding (params.max_tokens 0), which its
        finishing delta carries."""
        if request_id in self._sequences:
            raise RequestRejected(f"request id {request_id!r} is already in flight")
        if embed is None and self.config.task == "embed":
            raise RequestRejected("this engine serves embeddings only (--task embed): it generates no tokens")
        if embed is not None:
            self._check_embed(embed, params)
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        if params.priority and self.config.scheduling_policy != "priority":
            raise RequestRejected(
                f"priority {params.priority} needs the engine's --scheduling-policy priority (it runs fcfs, where "
                "every request's priority is 0)"
            )
        vocab_size = self.loaded.vocab_size
        token_ids = itertools.chain(prompt_token_ids, output_token_ids)
        if bad := _outside_vocabulary(token_ids, vocab_size):
            raise RequestRejected(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
        if len(output_token_ids) >= max(params.max_tokens, 1):
            raise RequestRejected(
                f"{len(output_token_ids)} tokens already generated leave none of max_tokens ({params.max_tokens})"
            )
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            if bad := _outside_vocabulary(ids, vocab_size):
                raise RequestRejected(f"{name} token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the model context of {self.max_model_len} tokens"
            )
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_time=arrival_time or time.monotonic(),
        )
        seq.token_ids.extend(output_token_ids)
        if embed is not None:
            seq.pooling, seq.embed_dimensions = self.loaded.pooling.method, embed.dimensions
        try:
            self.scheduler.check_fits(seq)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        if params.structured_outputs is not None:
            seq.matcher = self._matcher(params, output_token_ids)
        self._sequences[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_ids: list[str]) -> None:
        """Free the requests' blocks now; their final delta comes with the next step."""
        for request_id in request_ids:
            seq = self._sequences.pop(request_id, None)
            if seq is not None:
                self.scheduler.finish(seq, FinishReason.ABORT)
                self._aborted.append(_delta(seq, [], [], []))

    def has_unfinished(self) -> bool:
        return bool(self._sequences) or bool(self._aborted)

    def stats(self, expert_load: bool = False) -> EngineStats:
        """The engine's counters as the wire carries them to the gateways' metrics; with a mixture of
        experts' load per layer when asked (larger: the worker sends it once a second)."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_used=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_cache_queries=self.scheduler.num_prefix_queries,
            num_prefix_cache_hits=self.scheduler.num_prefix_hits,
            num_queued_prefill_tokens=self.scheduler.num_queued_prefill_tokens,
            expert_tokens=self.expert_load() if expert_load else [],
            preemptions_by_priority=dict(self.scheduler.preemptions_by_priority),
            **self._speculation_counts(),
        )

    def _speculation_counts(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        return {f"spec_{name}": value for name, value in dataclasses.asdict(self.speculator.counters).items()}

    def expert_load(self) -> list[list[int]]:
        """A mixture of experts' tokens routed to each expert, per decoder layer ([] for a dense model)."""
        return routed_tokens_by_layer(self.runner.model)

    def step(self) -> list[RequestDelta]:
        deltas, self._aborted = self._aborted, []
        self._propose_drafts()
        decision = self.scheduler.schedule()
        if self.schedule_observer is not None:
            self.schedule_observer(decision)
        for seq in decision.finished:
            deltas.append(self._finished_delta(seq, []))
        if decision.is_empty:
            return deltas
        chunks = self._chunks(decision)
        started = time.perf_counter()
        results = self.runner.execute(chunks)
        self.step_samples.append(_step_sample(decision, time.perf_counter() - started))
        for seq, num_tokens, chunk, result in zip(decision.seqs, decision.num_scheduled_tokens, chunks, results):
            add_pooled(seq, seq.num_computed_tokens, result.pooled)
            seq.prompt_logprobs.extend(result.prompt_logprobs)
            if result.sampled:
                deltas.append(self._verify(seq, num_tokens, chunk, result.sampled))
                continue
            seq.num_computed_tokens += num_tokens
            self.scheduler.cache_computed_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            if seq.pooling is not None:
                self.scheduler.finish(seq, FinishReason.STOP)
                deltas.append(self._finished_delta(seq, [], embedding=embedding_bytes(seq, self.loaded.pooling)))
            elif seq.params.max_tokens == 0:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                deltas.append(self._finished_delta(seq, [], [], seq.prompt_logprobs))
        return deltas

    def _verify(self, seq: Sequence, num_tokens: int, chunk: SequenceChunk, sampled: list[TokenLogprob]) -> RequestDelta:
        """Append the sampled tokens a chunk's rows agree on: the first, then after each draft equal to
        the token sampled before it the next one (speculator.py); release what rejected drafts took."""
        drafts = chunk.token_ids[len(chunk.token_ids) - len(sampled) + 1 :]
        num_accepted = next((i for i, (draft, token) in enumerate(zip(drafts, sampled)) if draft != token.token_id), len(drafts))
        num_before, num_logprobs = seq.num_tokens, len(seq.logprobs)
        reason = self._append_tokens(seq, sampled[: num_accepted + 1])
        num_appended = seq.num_tokens - num_before
        # the decode row's token and the accepted drafts now have their K/V in the cache
        seq.num_computed_tokens += num_tokens - len(drafts) + min(num_appended, num_accepted)
        if drafts:
            self.speculator.record(seq.drafts, len(drafts), num_accepted, num_appended, seq.num_output_tokens)
            self.scheduler.release_rejected_drafts(seq)
        self.scheduler.cache_computed_blocks(seq)
        new_token_ids, logprobs = seq.token_ids[num_before:], seq.logprobs[num_logprobs:]
        prompt_logprobs = seq.prompt_logprobs if seq.num_output_tokens == num_appended else []
        if reason is None:
            return _delta(seq, new_token_ids, logprobs, prompt_logprobs)
        self.scheduler.finish(seq, reason)
        return self._finished_delta(seq, new_token_ids, logprobs, prompt_logprobs)

    def _propose_drafts(self) -> None:
        """Drafts for the running sequences that decode next step (speculative decoding, when on)."""
        if self.speculator is None:
            return
        batch_size = self.scheduler.num_unfinished
        for seq in self.scheduler.running.values():
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if seq.num_uncomputed_tokens != 1 or seq.matcher is not None:
                room = 0  # a prompt chunk; or a constraint, whose next tokens' masks depend on each other
            self.speculator.propose(seq.token_ids, seq.drafts, seq.num_output_tokens, room, batch_size)

    def _check_embed(self, embed: EmbedOptions, params: SamplingParams) -> None:
        if params.max_tokens != 0:
            raise RequestRejected(f"an embedding request generates no tokens: max_tokens must be 0, got {params.max_tokens}")
        if embed.dimensions is not None:
            pooling = self.loaded.pooling
            error = dimensions_error(embed.dimensions, self.hidden_size, pooling.matryoshka_dimensions)
            if error is not None:
                raise RequestRejected(error)

    @property
    def hidden_size(self) -> int:
        """The values of an embedding: the model's final hidden state's."""
        return self.loaded.model.config.hidden_size

    def _matcher(self, params: SamplingParams, output_token_ids: Sequence_[int]) -> Any:
        """The constraint's matcher, past the tokens generated before a resume."""
        if self._constraints is None:
            raise RequestRejected("structured outputs need a tokenizer and this model has none")
        try:
            matcher = self._constraints.matcher(params.structured_outputs)
        except StructuredOutputError as exc:
            raise RequestRejected(str(exc)) from None
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise RequestRejected(f"the tokens already generated break the constraint: {matcher.get_error()}")
        return matcher

    def _chunks(self, decision: SchedulerOutput) -> list[SequenceChunk]:
        samples = [
            seq.num_computed_tokens + num_tokens >= seq.num_tokens and seq.params.max_tokens > 0
            for seq, num_tokens in zip(decision.seqs, decision.num_scheduled_tokens)
        ]
        constrained = [seq for seq, sampled in zip(decision.seqs, samples) if sampled and seq.matcher is not None]
        token_masks = {}
        if constrained:
            masks = self._token_masks.next_token_masks([seq.matcher for seq in constrained])
            token_masks = {seq.seq_id: mask for seq, mask in zip(constrained, masks)}
        chunks = []
        for seq, num_tokens, sampled in zip(decision.seqs, decision.num_scheduled_tokens, samples):
            start = seq.num_computed_tokens
            drafts = seq.drafts.token_ids if sampled else []  # the scheduler fitted them to num_tokens
            sampling = ()
            if sampled:
                mask = token_masks.get(seq.seq_id)
                sampling = tuple(self._sampling_request(seq, drafts[:i], mask) for i in range(len(drafts) + 1))
            chunks.append(
                SequenceChunk(
                    token_ids=seq.token_ids[start : start + num_tokens - len(drafts)] + drafts,
                    start_position=start,
                    block_tables=self.block_manager.block_tables(seq.seq_id),
                    sampling=sampling,
                    scoring=_prompt_scoring(seq, start, num_tokens),
                    num_prompt_tokens=seq.num_prompt_tokens,
                    pooled_rows=pooled_rows(seq, start, num_tokens),
                )
            )
        return chunks

    def _sampling_request(self, seq: Sequence, drafted: list[int], token_mask: TokenMask | None) -> SamplingRequest:
        """How the row after seq's tokens and the drafts before it samples: as the decode at that
        output index would."""
        params = seq.params
        output_index = seq.num_output_tokens + len(drafted)
        banned: tuple[int, ...] = ()
        if output_index < params.min_tokens:
            banned = tuple(self.stop_token_ids | set(params.stop_token_ids))
        history = params.needs_token_history
        return SamplingRequest(
            params=params,
            output_index=output_index,
            banned_token_ids=banned,
            prompt_token_ids=seq.prompt_token_ids if history else None,
            output_token_ids=seq.output_token_ids + drafted if history else None,
            token_mask=token_mask,
        )

    def _append_tokens(self, seq: Sequence, tokens: list[TokenLogprob]) -> FinishReason | None:
        """Append tokens to seq up to the first that finishes it; why it finishes, if one does."""
        for token in tokens:
            seq.token_ids.append(token.token_id)
            if seq.matcher is not None:
                seq.matcher.consume_token(token.token_id)
            if token.logprob is not None:
                seq.logprobs.append(token)
            if (reason := self._stop_reason(seq, token.token_id)) is not None:
                return reason
        return None

    def _finished_delta(
        self,
        seq: Sequence,
        new_token_ids: list[int],
        logprobs: list | None = None,
        prompt_logprobs: list | None = None,
        embedding: bytes = b"",
    ) -> RequestDelta:
        self._sequences.pop(seq.request_id, None)
        return _delta(seq, new_token_ids, logprobs or [], prompt_logprobs or [], embedding)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if seq.matcher is not None and seq.matcher.is_stopped():  # the constraint is complete
            return FinishReason.STOP
        stop_token = token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.stop_token_ids)
        if stop_token and seq.num_output_tokens >= params.min_tokens:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _check_kv_cache_fits(pool_bytes: int, device: torch.device) -> None:
    """Refuse at start a KV pool the device's free memory cannot hold, rather than letting the
    allocation fail, or on Linux swap and draw the OOM killer onto the whole host."""
    available = available_memory(device)
    if available is not None and pool_bytes > available:
        raise ValueError(
            f"the KV cache needs {pool_bytes / 2**30:.2f} GiB but {device.type} has {available / 2**30:.2f} GiB "
            "free: lower --kv-cache-mib / --num-blocks"
        )


def _max_model_len(model_limit: int, requested: int | None, cache_tokens: int) -> int:
    """The context a request may use: within the model's positions, and one sequence alone must fit
    the KV cache, else it would be cut off mid-generation. As in vLLM, an explicit --max-model-len
    over either is refused at start."""
    if requested is not None and requested > model_limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's context of {model_limit} positions")
    if requested is not None and requested > cache_tokens:
        raise ValueError(
            f"max_model_len {requested} exceeds the KV cache's {cache_tokens} tokens: "
            "enlarge --kv-cache-mib / --num-blocks or lower --max-model-len"
        )
    limit = requested or model_limit
    if limit > cache_tokens:
        logger.warning(
            "max_model_len lowered from the model's %d to the KV cache's %d tokens; enlarge --kv-cache-mib for more",
            limit, cache_tokens,
        )
    return min(limit, cache_tokens)


def _prompt_scoring(seq: Sequence, start: int, num_tokens: int) -> PromptScoring | None:
    """The chunk's rows at positions p < num_prompt_tokens - 1 not scored yet score prompt token p + 1."""
    if seq.params.prompt_logprobs is None:
        return None
    first, end = max(start, len(seq.prompt_logprobs)), min(start + num_tokens, seq.num_prompt_tokens - 1)
    if first >= end:
        return None
    return PromptScoring(first - start, seq.prompt_token_ids[first + 1 : end + 1], seq.params.prompt_logprobs)


def _step_sample(decision: SchedulerOutput, seconds: float) -> StepSample:
    """Prefill: the tokens before a sequence's last (its prompt's chunks, or its recomputation after a
    preemption); decode: each sequence's last token and its drafts."""
    prefill = sum(
        min(num_tokens, max(seq.num_tokens - 1 - seq.num_computed_tokens, 0))
        for seq, num_tokens in zip(decision.seqs, decision.num_scheduled_tokens)
    )
    total = sum(decision.num_scheduled_tokens)
    return StepSample(prefill, total - prefill, len(decision.seqs), seconds)


def _outside_vocabulary(token_ids: Iterable[object], vocab_size: int) -> list[object]:
    """The first id that is not an int in [0, vocab_size), as a one-item list (so that a bad None is
    told apart from no bad id); empty when every id is one."""
    return next(([t] for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), [])


def _delta(
    seq: Sequence,
    new_token_ids: list[int],
    logprobs: list[TokenLogprob],
    prompt_logprobs: list[TokenLogprob],
    embedding: bytes = b"",
) -> RequestDelta:
    """What one step produced for one request (its finish reason once it has one)."""
    return RequestDelta(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        num_prompt_tokens=seq.num_prompt_tokens,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        prompt_logprobs=prompt_logprobs,
        embedding=embedding,
    )
