"""Paged attention: new K/V are scattered into their cache slots, then every sequence attends over
the K/V it holds through its block table. Decodes take the path the runner chose at start (ember's
C++ kernel, FlexAttention, or SDPA over gathered blocks); prompt chunks take SDPA over their
gathered blocks. One entry point, so the models never see which.

A layer may slide (it sees only the last `sliding_window` positions: Mistral, Gemma) and soft-cap
its logits (Gemma 2). Layers are grouped by what they keep in the KV cache (the block manager's KV
cache groups): a step's metadata holds one AttentionMetadata per group, with that group's slots and
block tables, and each layer reads its group's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.flex_decode import flex_decode_attention
from ember_core.layers.kv_quant import is_quantized, quantize, widen
from ember_core.layers.linear import SMALL_BATCH_ROWS
from ember_core.layers.recurrent_batch import RecurrentBatch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


@dataclass
class PrefillSlice:
    """A sequence computing several tokens this step (a prompt, a prompt chunk, or a recompute)."""

    token_start: int  # index of its first token in the flat batch
    num_tokens: int
    context_len: int  # tokens in the cache once this step's are written
    block_table: torch.Tensor  # [num_blocks_held]
    # Set for a chunk whose tokens attend token by token through the decode kernel, as their decodes
    # would (wherever the runner's decodes do): each token's bits then do not depend on how the
    # scheduler split the prompt or how much of it the prefix cache held. Token i's decode operands:
    token_block_tables: torch.Tensor | None = None  # [num_tokens, num_blocks_held] int32
    token_context_lens: torch.Tensor | None = None  # [num_tokens] int32: context_len - num_tokens + i + 1


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of every token in the batch
    # Sequences computing exactly one token (decodes), batched together.
    decode_token_index: torch.Tensor  # [num_decodes]
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    # How decodes attend: ember's C++ kernel (both None), FlexAttention over this block mask, or
    # SDPA over gathered blocks with this key mask, [num_decodes, 1, 1, max_blocks * block_size].
    decode_block_mask: BlockMask | None
    decode_key_mask: torch.Tensor | None
    prefills: list[PrefillSlice]

    sliding_window: int | None = None  # the group's: its block tables hold only the window's blocks

    @property
    def num_decodes(self) -> int:
        return self.decode_token_index.numel()

    @property
    def decodes_only_on_kernel(self) -> bool:
        """Every token is a decode and the C++ kernel attends (CPU): a layer may run as one C++ call."""
        return not self.prefills and self.decode_block_mask is None and self.decode_key_mask is None


@dataclass
class ForwardMetadata:
    """What a model's forward needs beyond token ids and positions."""

    groups: list[AttentionMetadata]  # one per KV cache group; a layer reads groups[its kv_group]
    # Per token, the length of its sequence's prompt: LongRoPE picks its table by it (models/rotary.py).
    prompt_lengths: torch.Tensor
    adapters: bool = False  # some rows run with a LoRA adapter (lora/slots.py)
    states: RecurrentBatch | None = None  # a hybrid model's: each sequence's state slot

    @property
    def decodes_only_on_kernel(self) -> bool:
        return self.groups[0].decodes_only_on_kernel


def decode_key_mask(
    context_lens: torch.Tensor, max_blocks: int, block_size: int, sliding_window: int | None = None
) -> torch.Tensor:
    """True where a decode row's padded, gathered keys hold its context (within its window)."""
    key_positions = torch.arange(max_blocks * block_size, device=context_lens.device).unsqueeze(0)
    visible = key_positions < context_lens.unsqueeze(1)
    if sliding_window is not None:
        visible &= key_positions >= (context_lens - sliding_window).unsqueeze(1)
    return visible.view(len(context_lens), 1, 1, max_blocks * block_size)


def attention_with_mask(
    q: torch.Tensor,  # [..., heads, queries, head_dim]
    keys: torch.Tensor,  # [..., kv_heads, keys, head_dim]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcast to [..., heads, queries, keys]; None: causal, as many keys as queries
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """SDPA, or where logits are soft-capped (which SDPA cannot do) the same written out as
    transformers' eager attention: scores * scale, cap * tanh(scores / cap), masked softmax in float32."""
    gqa = keys.shape[-3] != q.shape[-3]
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // keys.shape[-3]
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.tanh(torch.matmul(q, keys.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


def gathered_decode_attention(
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    key_mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    # [B, max_blocks, block_size, kv, d] -> [B, kv, L, d], in the query's dtype (the cache's may be
    # narrower, or 8-bit). A sliding window's dropped (-1) entries gather some block that the mask hides.
    keys = widen(key_cache[block_tables], q.dtype).flatten(1, 2).transpose(1, 2)
    values = widen(value_cache[block_tables], q.dtype).flatten(1, 2).transpose(1, 2)
    return attention_with_mask(q.unsqueeze(2), keys, values, key_mask, scale, softcap).squeeze(2)


def _decode_attention(
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    if meta.decode_block_mask is not None:
        return flex_decode_attention(q, key_cache, value_cache, meta.decode_block_mask, scale)
    if meta.decode_key_mask is not None:
        return gathered_decode_attention(
            q, key_cache, value_cache, meta.decode_block_tables, meta.decode_key_mask, scale, softcap
        )
    # Reads each sequence's K/V in place through its block table (ember_core/kernels).
    return cpu_ops.ops().paged_decode_attention(
        q, key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens, scale, softcap or 0.0,
        meta.sliding_window or 0,
    )


def write_kv_cache_(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """key / value [num_tokens, num_kv_heads, head_dim] into the cache slots slot_mapping names."""
    # One C++ call instead of two index_copy_; it also rounds float32 rows into a narrower cache, and
    # quantizes rows of any dtype into an 8-bit one.
    quantized = is_quantized(key_cache.dtype)
    if key_cache.is_cpu and cpu_ops.is_available() and (quantized or key.dtype in (key_cache.dtype, torch.float32)):
        cpu_ops.ops().write_kv_cache_(key_cache, value_cache, slot_mapping, key, value)
        return
    num_kv_heads, row = key_cache.shape[2:]
    for cache, rows in ((key_cache, key), (value_cache, value)):
        stored = quantize(rows, cache.dtype) if quantized else rows.to(cache.dtype)
        # index_copy_ has no 8-bit float kernel: an e4m3 cache is written through its bytes.
        cache.view(torch.int8 if quantized else cache.dtype).view(-1, num_kv_heads, row).index_copy_(
            0, slot_mapping, stored.view(torch.int8) if quantized else stored
        )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    if not meta.prefills:  # every token is the decode of its own sequence, in batch order
        return _decode_attention(query, key_cache, value_cache, meta, scale, softcap)
    out = torch.empty_like(query)
    if meta.num_decodes:
        out[meta.decode_token_index] = _decode_attention(
            query[meta.decode_token_index], key_cache, value_cache, meta, scale, softcap
        )
    window = meta.sliding_window
    for p in meta.prefills:
        chunk = slice(p.token_start, p.token_start + p.num_tokens)
        if p.token_context_lens is not None:
            out[chunk] = cpu_ops.ops().paged_decode_attention(
                query[chunk].contiguous(), key_cache, value_cache, p.token_block_tables, p.token_context_lens, scale,
                softcap or 0.0, window or 0,
            )
            continue
        # A sliding window gathers from the block of the first key its first query sees.
        first_query = p.context_len - p.num_tokens
        first_block = max(0, first_query - window + 1) // key_cache.shape[1] if window else 0
        first_key = first_block * key_cache.shape[1]
        keys = key_cache[p.block_table[first_block:]].flatten(0, 1)[: p.context_len - first_key].transpose(0, 1)
        values = value_cache[p.block_table[first_block:]].flatten(0, 1)[: p.context_len - first_key].transpose(0, 1)
        keys, values = widen(keys, query.dtype), widen(values, query.dtype)
        q = query[chunk].transpose(0, 1)  # [heads, n, d]
        long_chunk = p.num_tokens > SMALL_BATCH_ROWS
        if long_chunk:
            # With a batch dimension SDPA takes its flash kernel: 3-4x faster at long contexts, but its
            # bits depend on the chunk's length (decodes on the C++ kernel never come here).
            q, keys, values = q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0)
        mask = None
        if first_key or p.context_len != p.num_tokens or window:
            mask = _prefill_mask(first_query, p.num_tokens, first_key, p.context_len, window, query.device)
        attn = attention_with_mask(q, keys, values, mask, scale, softcap)
        out[chunk] = (attn[0] if long_chunk else attn).transpose(0, 1)
    return out


def _prefill_mask(
    first_query: int, num_queries: int, first_key: int, context_len: int, window: int | None, device: torch.device
) -> torch.Tensor | object:
    """Query i at position first_query + i sees the keys at positions first_key + j up to its own
    (within its window). Without a window, on CUDA: torch's CausalBias, which the flash kernel applies
    without building it. On CPU, SDPA builds that bias into this very mask anyway (same bits), and
    importing torch.nn.attention.bias pulls in torch._dynamo: ~2 s of every engine start."""
    if device.type == "cuda" and window is None and first_key == 0:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(num_queries, context_len)
    query_positions = torch.arange(first_query, first_query + num_queries, device=device).unsqueeze(1)
    key_positions = torch.arange(first_key, context_len, device=device).unsqueeze(0)
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    return visible


class PagedAttention(nn.Module):
    """Attention over the paged KV cache; the model runner binds `key_cache` / `value_cache` and the
    layer's KV cache group (`kv_group`: which of the step's AttentionMetadata it reads)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.kv_group = 0
        self.key_cache = torch.empty(0)
        self.value_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        group = meta.groups[self.kv_group]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv_cache_(self.key_cache, self.value_cache, group.slot_mapping, k, v)
        out = paged_attention(q, self.key_cache, self.value_cache, group, self.scale, self.softcap)
        return out.view(num_tokens, self.num_heads * self.head_dim)
