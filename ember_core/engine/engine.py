"""The engine: tokens in, tokens out. Requests pass the intake (intake.py) and wait in the
scheduler; each step schedules, builds the runner's input (step_inputs.py), runs the model, appends
what it sampled (outputs.py, speculation verified here) and returns every request's delta."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ember_core.auto_dtype import requested_dtype
from ember_core.cache.block_manager import BlockManager
from ember_core.config import EngineConfig, lora_module
from ember_core.device import resolve_device
from ember_core.engine.embedding import add_pooled, embedding_bytes
from ember_core.engine.intake import RequestIntake, RequestRejected
from ember_core.engine.kv_pool import max_model_len, pool_blocks
from ember_core.engine.outputs import append_tokens, delta
from ember_core.engine.scheduler import Scheduler, SchedulerOutput
from ember_core.engine.sequence import Sequence
from ember_core.engine.speculator import Speculator
from ember_core.engine.state_checkpoints import StateCheckpoints
from ember_core.engine.state_slots import StateSlots, refuse_for_hybrid, state_pool_slots
from ember_core.engine.stats import engine_stats, step_sample
from ember_core.engine.step_inputs import step_chunks
from ember_core.layers.kv_quant import kv_cache_dtype, kv_cache_dtype_name
from ember_core.layers.linear import SMALL_BATCH_ROWS
from ember_core.layers.moe import routed_tokens_by_layer
from ember_core.loaders import LoadedModel, load_model
from ember_core.lora.errors import AdapterError
from ember_core.lora.files import read_adapter
from ember_core.lora.slots import AdapterSlots
from ember_core.lora.sources import AdapterSource, is_local_path
from ember_core.lora.weights import AdapterWeights
from ember_core.parallel.follower import RankSetup
from ember_core.parallel.ranks import LeaderRanks
from ember_core.runner.context_cost import context_cost_per_position
from ember_core.runner.inputs import SequenceChunk
from ember_core.runner.kv_cache_layout import kv_cache_layout
from ember_core.runner.model_runner import ModelRunner
from ember_core.runner.state_pool import state_bytes_per_slot
from ember_core.runner.token_masks import TokenMaskFiller
from ember_core.sampling_params import SamplingParams
from ember_core.speculative_config import speculative_config
from ember_core.structured_outputs import ConstraintCompiler
from ember_core.tokenizer import Tokenizer
from ember_proto import BLOCK_MAP_STEPS, EmbedOptions, EngineStats, FinishReason, RequestDelta, StepSample, TokenLogprob

__all__ = ["Engine", "RequestRejected"]

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        device = resolve_device(config.device)
        if config.tensor_parallel_size > 1 and device.type != "cpu":
            raise ValueError(f"tensor parallelism runs CPU ranks so far (gloo and shared memory), not {device.type}: use --device cpu")
        # Tensor parallelism: this engine is rank 0, and its followers run each step with it.
        self.ranks = None if config.tensor_parallel_size == 1 else LeaderRanks(config)
        parallel = None if self.ranks is None else self.ranks.parallel
        try:
            self.loaded = loaded or load_model(
                config.model, device, requested_dtype(config.dtype, device), compact_weights=config.gguf_weights == "blocks",
                numerics=config.numerics, parallel=parallel,
            )
            model, dtype = self.loaded.model, self.loaded.dtype
            kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, device)
            layout = kv_cache_layout(model)
            bytes_per_block = layout.bytes_per_block(config.block_size, kv_dtype)
            bytes_per_slot = state_bytes_per_slot(model, dtype)
            running_slots = checkpoint_slots = 0
            if bytes_per_slot:
                refuse_for_hybrid(config)
                running_slots, checkpoint_slots = state_pool_slots(config, bytes_per_slot)
            state_bytes = (running_slots + checkpoint_slots) * bytes_per_slot
            num_blocks = pool_blocks(config, bytes_per_block, device, state_bytes)
        except BaseException:
            self.close()  # the followers wait for the setup: they stop instead
            raise
        if self.ranks is not None:
            self.ranks.share(RankSetup(dtype, self.loaded.numerics, num_blocks, kv_dtype))
        self.kv_cache_dtype = kv_cache_dtype_name(kv_dtype)  # what the engine reports, and its hashes' key
        self.kv_cache_bytes = num_blocks * bytes_per_block
        self.state_pool_bytes = state_bytes
        self.block_manager = BlockManager(num_blocks, config.block_size, layout.group_windows)
        cache_tokens = self.block_manager.longest_fitting_sequence(self.loaded.max_model_len, config.max_num_batched_tokens)
        logger.info(
            "KV cache: %d blocks x %d tokens in %d group(s) of %d layers (%.1f MiB, %s): one sequence may hold %d tokens",
            num_blocks, config.block_size, len(layout.group_windows), layout.layers_per_group,
            num_blocks * bytes_per_block / 2**20, kv_dtype, cache_tokens,
        )
        if state_bytes:
            logger.info(
                "state pool: %d slots for running sequences and %d for prefix checkpoints, %.2f MiB each, %.1f MiB "
                "beside the KV blocks of the attention layers%s",
                running_slots, checkpoint_slots, bytes_per_slot / 2**20, state_bytes / 2**20,
                f"; at most {running_slots} sequences run at once (raise --kv-cache-mib for more)"
                if running_slots < config.max_num_seqs else "",
            )
        logger.info(
            "serving %s: dtype %s, numerics %s, KV cache %s, CPU build %s (what its bits depend on besides the requests)",
            self.loaded.name, str(dtype).removeprefix("torch."), self.loaded.numerics, self.kv_cache_dtype,
            self.loaded.cpu_build or device.type,
        )
        self.max_model_len = max_model_len(self.loaded.max_model_len, config.max_model_len, cache_tokens)
        if config.max_num_seqs > config.max_num_batched_tokens:
            logger.warning(
                "max_num_seqs %d > max_num_batched_tokens %d: every running sequence takes at least one token "
                "of a step, so at most %d run at once",
                config.max_num_seqs, config.max_num_batched_tokens, config.max_num_batched_tokens,
            )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=running_slots or config.max_num_seqs,
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
        self.runner = ModelRunner(
            model, num_blocks, config.block_size, kv_dtype, config.decode_attention, parallel,
            num_state_slots=running_slots + checkpoint_slots,
        )
        self.state_slots = StateSlots(running_slots) if running_slots else None
        self.scheduler.state_slots = self.state_slots
        if checkpoint_slots:
            self.scheduler.state_checkpoints = StateCheckpoints(running_slots, checkpoint_slots)
        self.adapters: AdapterSlots | None = None
        if config.enable_lora:
            self.adapters = AdapterSlots(model, config.max_loras, config.max_lora_rank, config.lora_dtype)
            self.runner.adapter_rows = self.adapters.rows
            self.scheduler.adapters = self.adapters
            for name, path in map(lora_module, config.lora_modules):
                self.add_adapter(name, path)
        self.stop_token_ids = self.loaded.stop_token_ids
        tokenizer = self.loaded.tokenizer
        self.intake = RequestIntake(
            config, self.loaded.vocab_size, self.max_model_len, self.hidden_size, self.loaded.pooling,
            None if tokenizer is None else ConstraintCompiler(tokenizer, self.loaded.vocab_size, sorted(self.stop_token_ids)),
        )
        self._token_masks = TokenMaskFiller(self.loaded.vocab_size)
        spec = speculative_config(config.speculative_config)  # EngineConfig holds it parsed already
        self.speculator = None if spec is None else Speculator(spec)
        self._sequences: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._aborted: list[RequestDelta] = []
        # Sees each step's schedule before the step runs (the engine worker's tracing, when on).
        self.schedule_observer: Callable[[SchedulerOutput], None] | None = None
        self.step_samples: deque[StepSample] = deque(maxlen=BLOCK_MAP_STEPS)  # for dashboards

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.loaded.tokenizer

    @property
    def hidden_size(self) -> int:
        """The values of an embedding: the model's final hidden state's."""
        model_config: Any = self.loaded.model.config  # the model's own (nn.Module types it as a Module)
        return int(model_config.hidden_size)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_token_ids: list[int] | tuple[int, ...] = (),
        embed: EmbedOptions | None = None,
        adapter: str = "",
    ) -> None:
        """adapter: the name of a loaded LoRA adapter the request runs with (add_adapter).
        output_token_ids: what the request already generated on an engine that was lost. It
        continues after them as if it had never stopped: they count toward max_tokens, min_tokens and
        the penalties, and a seeded request samples the same tokens it would have. params.priority:
        lower runs first under the priority scheduling policy; under fcfs only 0 is taken (as vLLM).
        embed: the request wants its prompt's pooled embedding (params.max_tokens 0), which its
        finishing delta carries."""
        if request_id in self._sequences:
            raise RequestRejected(f"request id {request_id!r} is already in flight")
        seq = self.intake.sequence(
            next(self._seq_ids), request_id, prompt_token_ids, params, arrival_time or time.monotonic(),
            output_token_ids, embed,
        )
        if adapter:
            if self.adapters is None or adapter not in self.adapters.names:
                raise RequestRejected(f"no LoRA adapter {adapter!r} is loaded")
            seq.adapter = adapter  # its slot comes with its admission (Scheduler.adapters)
        try:
            self.scheduler.check_fits(seq)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        if params.structured_outputs is not None:
            seq.matcher = self.intake.matcher(params.structured_outputs, output_token_ids)
        self._sequences[request_id] = seq
        self.scheduler.add(seq)

    def add_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter under name, as its operator names it (lora/files.py: a PEFT checkpoint
        or a llama.cpp GGUF, by path or from the Hub); AdapterError, with nothing loaded, when it
        cannot serve this model."""
        self.install_adapter(name, self.read_adapter(AdapterSource(path, from_hub=not is_local_path(path))))

    def read_adapter(self, source: AdapterSource) -> AdapterWeights:
        """add_adapter's first half: the file read and checked against the model, nothing loaded (safe
        on another thread)."""
        if self.adapters is None:
            raise AdapterError("LoRA adapters need an engine started with enable_lora (--enable-lora)")
        return read_adapter(source, self.adapters.config)

    def install_adapter(self, name: str, adapter: AdapterWeights) -> None:
        """add_adapter's second half, for a checkpoint read already (the engine worker reads it on a
        thread of its own)."""
        if self.adapters is None:
            raise AdapterError("LoRA adapters need an engine started with enable_lora (--enable-lora)")
        if name in self.adapters.names:
            raise AdapterError(f"a LoRA adapter named {name!r} is loaded already")
        self.adapters.load(name, adapter)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter; LookupError when none is called name, ValueError while a request runs with it."""
        if self.adapters is None or name not in self.adapters.names:
            raise LookupError(f"no LoRA adapter {name!r} is loaded")
        if any(seq.adapter == name for seq in self._sequences.values()):
            raise ValueError(f"LoRA adapter {name!r} is in use by requests in flight")
        self.adapters.unload(name)

    def abort(self, request_ids: list[str]) -> None:
        """Free the requests' blocks now; their final delta comes with the next step."""
        for request_id in request_ids:
            seq = self._sequences.pop(request_id, None)
            if seq is not None:
                self.scheduler.finish(seq, FinishReason.ABORT)
                self._aborted.append(delta(seq, [], [], []))

    def check_ranks(self) -> None:
        """RankLost when a tensor-parallel follower on this host has exited."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """Stop the tensor-parallel followers (a no-op without them)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def has_unfinished(self) -> bool:
        return bool(self._sequences) or bool(self._aborted)

    def stats(self, expert_load: bool = False) -> EngineStats:
        """The engine's counters; with a mixture of experts' load per layer when asked (larger: the
        worker sends it once a second)."""
        return engine_stats(
            self.scheduler, self.block_manager, self.speculator, self.expert_load() if expert_load else [], self.state_slots
        )

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
        chunks = step_chunks(decision, self.block_manager.block_tables, self._token_masks, self.stop_token_ids)
        started = time.perf_counter()
        self.runner.copy_states(self.scheduler.take_state_copies())  # restored prefix checkpoints
        results = self.runner.execute(chunks)
        self.step_samples.append(step_sample(decision, time.perf_counter() - started))
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
        self.runner.copy_states(self.scheduler.take_state_copies())  # checkpoints of this step's states
        return deltas

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

    def _verify(self, seq: Sequence, num_tokens: int, chunk: SequenceChunk, sampled: list[TokenLogprob]) -> RequestDelta:
        """Append the sampled tokens a chunk's rows agree on: the first, then after each draft equal to
        the token sampled before it the next one (speculator.py); release what rejected drafts took."""
        drafts = chunk.token_ids[len(chunk.token_ids) - len(sampled) + 1 :]
        num_accepted = next((i for i, (draft, token) in enumerate(zip(drafts, sampled)) if draft != token.token_id), len(drafts))
        num_before, num_logprobs = seq.num_tokens, len(seq.logprobs)
        reason = append_tokens(seq, sampled[: num_accepted + 1], self.stop_token_ids, self.max_model_len)
        num_appended = seq.num_tokens - num_before
        # the decode row's token and the accepted drafts now have their K/V in the cache
        seq.num_computed_tokens += num_tokens - len(drafts) + min(num_appended, num_accepted)
        if drafts:
            assert self.speculator is not None  # only a speculator drafts
            self.speculator.record(seq.drafts, len(drafts), num_accepted, num_appended, seq.num_output_tokens)
            self.scheduler.release_rejected_drafts(seq)
        self.scheduler.cache_computed_blocks(seq)
        new_token_ids, logprobs = seq.token_ids[num_before:], seq.logprobs[num_logprobs:]
        prompt_logprobs = seq.prompt_logprobs if seq.num_output_tokens == num_appended else []
        if reason is None:
            return delta(seq, new_token_ids, logprobs, prompt_logprobs)
        self.scheduler.finish(seq, reason)
        return self._finished_delta(seq, new_token_ids, logprobs, prompt_logprobs)

    def _finished_delta(
        self,
        seq: Sequence,
        new_token_ids: list[int],
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
        embedding: bytes = b"",
    ) -> RequestDelta:
        self._sequences.pop(seq.request_id, None)
        return delta(seq, new_token_ids, logprobs or [], prompt_logprobs or [], embedding)
