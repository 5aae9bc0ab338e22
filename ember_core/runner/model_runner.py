"""Turns a step's chunks into batched tensors, runs the model over the paged KV pool, samples."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.attention import AttentionMetadata, PagedAttention, PrefillSlice
from ember_core.layers.linear import use_small_batch_linears
from ember_core.runner.inputs import SampledToken, SequenceChunk
from ember_core.runner.sampler import sample

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    element_size = torch.empty(0, dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * element_size for layer in layers)


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype | None = None) -> None:
        use_small_batch_linears(model)
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache_dtype = kv_cache_dtype or param.dtype
        # Decided once, so the kernel is built (or found in the cache) at engine start.
        kernel_available = self.device.type == "cpu" and cpu_ops.is_available()
        self.use_decode_kernel = kernel_available and cpu_ops.decode_attention_supports(self.dtype, self.kv_cache_dtype)
        if self.device.type == "cpu" and not kernel_available:
            logger.warning(
                "ember's C++ CPU ops are unavailable (%s): attention, linears and norms fall back to torch ops, "
                "several times slower",
                cpu_ops.unavailable_reason(),
            )
        elif kernel_available and not self.use_decode_kernel:
            logger.warning(
                "the decode-attention kernel does not take a %s model over a %s KV cache: decodes use SDPA over "
                "gathered blocks, several times slower",
                self.dtype, self.kv_cache_dtype,
            )
        # The KV pool: per layer K and V of shape [num_blocks, block_size, num_kv_heads, head_dim].
        for layer in model.modules():
            if isinstance(layer, PagedAttention):
                shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
                layer.key_cache = torch.zeros(shape, device=self.device, dtype=self.kv_cache_dtype)
                layer.value_cache = torch.zeros(shape, device=self.device, dtype=self.kv_cache_dtype)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_context_lens: list[int] = []
        prefills: list[PrefillSlice] = []
        for chunk in chunks:
            token_start = len(token_ids)
            num_tokens = len(chunk.token_ids)
            context_len = chunk.start_position + num_tokens
            chunk_positions = range(chunk.start_position, context_len)
            table = chunk.block_table
            token_ids.extend(chunk.token_ids)
            positions.extend(chunk_positions)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in chunk_positions)
            if num_tokens == 1:
                decode_index.append(token_start)
                decode_tables.append(table)
                decode_context_lens.append(context_len)
            else:
                held = -(-context_len // block_size)
                prefills.append(PrefillSlice(token_start, num_tokens, context_len, self._tensor(table[:held])))
        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        context_lens = torch.tensor(decode_context_lens, dtype=torch.int32, device=self.device)
        key_mask = None
        if not self.use_decode_kernel:
            key_positions = torch.arange(max_blocks * block_size, device=self.device)
            key_mask = (key_positions.unsqueeze(0) < context_lens.unsqueeze(1)).view(len(padded), 1, 1, max_blocks * block_size)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            decode_token_index=self._tensor(decode_index),
            decode_block_tables=torch.tensor(padded, dtype=torch.int32, device=self.device).view(len(padded), max_blocks),
            decode_context_lens=context_lens,
            decode_key_mask=key_mask,
            prefills=prefills,
        )
        return self._tensor(token_ids), self._tensor(positions), meta

    @torch.inference_mode()
    def forward_hidden(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Final hidden states of every token of the step, [num_tokens, hidden]."""
        input_ids, positions, meta = self.prepare(chunks)
        return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk]) -> list[SampledToken | None]:
        """Run one step; one sampled token for every chunk that ends its sequence's known tokens."""
        hidden = self.forward_hidden(chunks)
        last_token_rows: list[int] = []
        row = 0
        for chunk in chunks:
            row += len(chunk.token_ids)
            if chunk.sampling is not None:
                last_token_rows.append(row - 1)
        if not last_token_rows:
            return [None] * len(chunks)
        logits = self.model.compute_logits(hidden[last_token_rows])
        sampled = iter(sample(logits, [c.sampling for c in chunks if c.sampling is not None]))
        return [next(sampled) if c.sampling is not None else None for c in chunks]
