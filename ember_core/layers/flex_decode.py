"""Decode attention through FlexAttention over the paged KV cache: the compiled path for devices
without ember's C++ kernel (CUDA). A layer's whole cache is one key sequence of
num_blocks * block_size tokens; a decode row's block mask lists its sequence's blocks in order,
the full ones first-class and the last, partial one with a mask_mod hiding its unwritten tail, so
each row reads only the blocks its sequence holds, in place.

Rows are padded to a power of two and compiled with static shapes: one compile per bucket, reused
by every step of that size whatever the context lengths (the mask's tensors change, not its shape).

torch's FlexAttention is imported on first use: it pulls in torch._dynamo, ~2 s that an engine on
the C++ kernel (CPU) should not spend at every start.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def padded_rows(num_decodes: int) -> int:
    return 1 << max(num_decodes - 1, 0).bit_length()


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # One static-shape graph per bucket: 2^31 decode rows need 32, above dynamo's default of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    return torch.compile(flex_attention, dynamic=False)


def decode_block_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, num_cache_blocks: int, block_size: int) -> BlockMask:
    """block_tables [num_decodes, max_blocks] int32 (padded), context_lens [num_decodes] int32."""
    from torch.nn.attention.flex_attention import BlockMask
    num_decodes, max_blocks = block_tables.shape
    rows = padded_rows(num_decodes)
    device = block_tables.device
    lens = torch.zeros(rows, dtype=torch.int32, device=device)
    lens[:num_decodes] = context_lens
    full = lens // block_size
    partial = (lens % block_size != 0).to(torch.int32)
    fill = lens - full * block_size
    # The kernel wants one column per cache block; only the first num_blocks of each row are read.
    full_indices = torch.zeros(rows, 1, 1, num_cache_blocks, dtype=torch.int32, device=device)
    full_indices[:num_decodes, 0, 0, :max_blocks] = block_tables
    partial_indices = torch.zeros(rows, 1, 1, num_cache_blocks, dtype=torch.int32, device=device)
    if max_blocks:  # a partial block is the one after the full ones
        last = full[:num_decodes].clamp(max=max_blocks - 1).long().unsqueeze(1)
        partial_indices[:num_decodes, 0, 0, 0] = block_tables.gather(1, last).squeeze(1)

    def hide_unwritten_tail(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx % block_size < fill[b]

    return BlockMask.from_kv_blocks(
        partial.view(rows, 1, 1), partial_indices, full.view(rows, 1, 1), full_indices,
        BLOCK_SIZE=(128, block_size), mask_mod=hide_unwritten_tail,
        seq_lengths=(1, num_cache_blocks * block_size), compute_q_blocks=False,
    )


def flex_decode_attention(
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], q's dtype
    value_cache: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
) -> torch.Tensor:
    num_decodes, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    rows = block_mask.kv_num_blocks.shape[0]
    padded = q.new_zeros(rows, num_heads, 1, head_dim)
    padded[:num_decodes, :, 0] = q
    keys = key_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    values = value_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    out = _compiled_flex_attention()(
        padded, keys, values, block_mask=block_mask, scale=scale, enable_gqa=num_kv_heads != num_heads
    )
    return out[:num_decodes, :, 0]
