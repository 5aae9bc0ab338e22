"""Turns a step's chunks into batched tensors, runs the model over the paged KV pool, samples."""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

from ember_core.config import DecodeAttention
from ember_core.kernels import cpu_ops
from ember_core.layers.attention import AttentionMetadata, ForwardMetadata, PrefillSlice, decode_key_mask
from ember_core.layers.flex_decode import decode_block_mask
from ember_core.layers.kv_quant import cache_row
from ember_core.layers.linear import use_small_batch_linears
from ember_core.layers.lora import AdapterRows
from ember_core.layers.recurrent_batch import RecurrentBatch
from ember_core.parallel.group import TensorParallel
from ember_core.runner.decode_attention import choose_decode_attention
from ember_core.runner.inputs import ChunkResult, SequenceChunk, followers_view
from ember_core.runner.kv_cache_layout import attention_layers, kv_cache_layout
from ember_core.runner.sampler import sample, scored_tokens
from ember_core.runner.state_pool import bind_state_pool, copy_state_slots, recurrent_layers
from ember_proto import TokenLogprob

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype | None = None,
        decode_attention: DecodeAttention = "auto",
        parallel: TensorParallel | None = None,
        num_state_slots: int = 0,
    ) -> None:
        """parallel: the model is one tensor-parallel rank's part; the leader's execute sends each
        step to the followers, whose follow runs it. num_state_slots: a hybrid model's state pool
        (state_pool.py), one slot per sequence that may run at once."""
        use_small_batch_linears(model)
        self.model = model
        self.parallel = parallel
        self.adapter_rows: AdapterRows | None = None  # with LoRA adapters: each row's (lora/slots.py)
        self.num_blocks = num_blocks
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache_dtype = kv_cache_dtype or param.dtype
        self.layout = kv_cache_layout(model)
        # The KV pool: per layer of a group, K and V of shape [num_blocks, block_size, num_kv_heads,
        # head_dim] (an 8-bit cache's rows 2 longer, for their scale: layers/kv_quant.py); the j-th
        # layer of every group writes the j-th pair (kv_cache_layout.py).
        shape = (num_blocks, block_size, self.layout.num_kv_heads, cache_row(self.layout.head_dim, self.kv_cache_dtype))
        pool = [
            tuple(torch.zeros(shape, device=self.device, dtype=self.kv_cache_dtype) for _ in range(2))
            for _ in range(self.layout.layers_per_group)
        ]
        self.recurrent_layers = recurrent_layers(model)
        self.is_hybrid = bool(self.recurrent_layers)
        if self.is_hybrid:
            bind_state_pool(model, num_state_slots, self.dtype, self.device)
        layers = attention_layers(model)
        for layer, (group, slot) in zip(layers, self.layout.placement):
            layer.kv_group = group
            layer.key_cache, layer.value_cache = pool[slot]
        # Decided once, so kernels are built or compiled (or found in their caches) at engine start.
        self.decode_attention = choose_decode_attention(decode_attention, layers, self.dtype)
        logger.info("decode attention: %s", self.decode_attention)
        if self.device.type == "cpu" and cpu_ops.is_available():
            logger.info(
                "CPU kernels: the %s build (%s=%s to choose another)", cpu_ops.active_instruction_set().name,
                cpu_ops.ISA_ENVIRONMENT_VARIABLE, "|".join(isa.name for isa in cpu_ops.runnable_instruction_sets()),
            )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _prefill_slice(self, token_start: int, num_tokens: int, context_len: int, table: list[int]) -> PrefillSlice:
        """A chunk attends token by token through the decode kernel when decodes do, so a prompt split
        into chunks, or found partly cached, keeps the bits of a whole one (attention.PrefillSlice)."""
        token_tables = token_lens = None
        if self.decode_attention == "kernel":
            token_tables = torch.tensor(table, dtype=torch.int32, device=self.device).expand(num_tokens, -1).contiguous()
            token_lens = torch.arange(context_len - num_tokens + 1, context_len + 1, dtype=torch.int32, device=self.device)
        return PrefillSlice(
            token_start=token_start,
            num_tokens=num_tokens,
            context_len=context_len,
            block_table=self._tensor(table),
            token_block_tables=token_tables,
            token_context_lens=token_lens,
        )

    def prepare(self, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, ForwardMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        prompt_lengths: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.start_position + len(chunk.token_ids)))
            prompt_lengths.extend([chunk.num_prompt_tokens] * len(chunk.token_ids))
        groups = [self._group_metadata(chunks, group, window) for group, window in enumerate(self.layout.group_windows)]
        meta = ForwardMetadata(groups=groups, prompt_lengths=self._tensor(prompt_lengths))
        if self.is_hybrid:
            meta.states = RecurrentBatch.of(
                [len(c.token_ids) for c in chunks], [c.state_slot for c in chunks], [c.start_position == 0 for c in chunks],
                self.device,
            )
        if self.adapter_rows is not None:
            self.adapter_rows.set([c.adapter_slot for c in chunks for _ in c.token_ids], self.device)
            meta.adapters = self.adapter_rows.active
        return self._tensor(token_ids), self._tensor(positions), meta

    def _group_metadata(self, chunks: list[SequenceChunk], group: int, window: int | None) -> AttentionMetadata:
        """One KV cache group's slots and block tables for the step."""
        block_size = self.block_size
        slots: list[int] = []
        decode_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_context_lens: list[int] = []
        prefills: list[PrefillSlice] = []
        token_start = 0
        for chunk in chunks:
            num_tokens = len(chunk.token_ids)
            context_len = chunk.start_position + num_tokens
            table = chunk.block_tables[group]
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(chunk.start_position, context_len))
            if chunk.is_decode:  # a decode's drafts are decodes too, each seeing the rows before it
                decode_index.extend(range(token_start, token_start + num_tokens))
                decode_tables.extend([table] * num_tokens)
                decode_context_lens.extend(range(chunk.start_position + 1, context_len + 1))
            else:
                held = -(-context_len // block_size)
                prefills.append(self._prefill_slice(token_start, num_tokens, context_len, table[:held]))
            token_start += num_tokens
        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        block_tables = torch.tensor(padded, dtype=torch.int32, device=self.device).view(len(padded), max_blocks)
        context_lens = torch.tensor(decode_context_lens, dtype=torch.int32, device=self.device)
        block_mask = key_mask = None
        if self.decode_attention == "flex" and decode_tables:
            block_mask = decode_block_mask(block_tables, context_lens, self.num_blocks, block_size)
        elif self.decode_attention == "sdpa":
            key_mask = decode_key_mask(context_lens, max_blocks, block_size, window)
        return AttentionMetadata(
            slot_mapping=self._tensor(slots),
            decode_token_index=self._tensor(decode_index),
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            decode_block_mask=block_mask,
            decode_key_mask=key_mask,
            prefills=prefills,
            sliding_window=window,
        )

    @torch.inference_mode()
    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """A hybrid model's state slots copied (from, to): prefix checkpoints taken and restored."""
        copy_state_slots(self.recurrent_layers, copies)

    @torch.inference_mode()
    def forward_hidden(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Final hidden states of every token of the step, [num_tokens, hidden]."""
        input_ids, positions, meta = self.prepare(chunks)
        return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk]) -> list[ChunkResult]:
        """Run one step: a sampled token for each sampling row of the chunks (a chunk's last rows:
        its sequence's next token, and after each draft token the one that follows it), the logprobs
        of the prompt tokens the chunks score, and the hidden states embedding chunks pool."""
        if self.parallel is not None:
            self.parallel.broadcast(followers_view(chunks))
        hidden = self.forward_hidden(chunks)
        token_starts = _token_starts(chunks)
        rows = _sampled_rows(chunks)
        sampled = iter([])
        if rows:
            logits = self._logits(hidden, rows)
            sampled = iter(sample(logits, [request for c in chunks for request in c.sampling]))
        scored = iter(self._score_prompts(hidden, chunks, token_starts))
        return [
            ChunkResult(
                [next(sampled) for _ in c.sampling],
                [next(scored) for _ in c.scoring.next_token_ids] if c.scoring else [],
                _pooled(hidden, start, c.pooled_rows),
            )
            for c, start in zip(chunks, token_starts)
        ]

    @torch.inference_mode()
    def follow(self, chunks: list[SequenceChunk]) -> None:
        """A tensor-parallel follower's share of the leader's execute: the same forward pass and
        logits, for their collectives; the leader samples."""
        hidden = self.forward_hidden(chunks)
        for rows in (_sampled_rows(chunks), _scored_rows(chunks, _token_starts(chunks))):
            if rows:
                self._logits(hidden, rows)

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The logits of some rows of the step, through their adapters' heads where they have one."""
        if self.adapter_rows is None:
            return self.model.compute_logits(hidden[rows])
        with self.adapter_rows.selecting(rows):
            return self.model.compute_logits(hidden[rows])

    def _score_prompts(self, hidden: torch.Tensor, chunks: list[SequenceChunk], token_starts: list[int]) -> list[TokenLogprob]:
        rows, next_ids, num_top = _scored_rows(chunks, token_starts), [], []
        if not rows:
            return []
        for chunk in chunks:
            if chunk.scoring is not None:
                next_ids.extend(chunk.scoring.next_token_ids)
                num_top.extend([chunk.scoring.num_top] * len(chunk.scoring.next_token_ids))
        logits = self._logits(hidden, rows)
        return scored_tokens(logits, torch.tensor(next_ids, device=logits.device), num_top)


def _token_starts(chunks: list[SequenceChunk]) -> list[int]:
    return list(itertools.accumulate((len(c.token_ids) for c in chunks[:-1]), initial=0))


def _sampled_rows(chunks: list[SequenceChunk]) -> list[int]:
    """The step's rows that sample: each chunk's last len(sampling)."""
    ends = itertools.accumulate(len(c.token_ids) for c in chunks)
    return [row for c, end in zip(chunks, ends) for row in range(end - len(c.sampling), end)]


def _scored_rows(chunks: list[SequenceChunk], token_starts: list[int]) -> list[int]:
    """The step's rows whose next token is a prompt token to score (prompt_logprobs)."""
    rows: list[int] = []
    for chunk, token_start in zip(chunks, token_starts):
        if chunk.scoring is not None:
            first = token_start + chunk.scoring.first_row
            rows.extend(range(first, first + len(chunk.scoring.next_token_ids)))
    return rows


def _pooled(hidden: torch.Tensor, token_start: int, rows: tuple[int, int] | None) -> torch.Tensor | None:
    if rows is None:
        return None
    return hidden[token_start + rows[0] : token_start + rows[1]].float().sum(dim=0)
