"""Prefix block hashes: one torch-free function the engine's prefix cache and the gateways'
KV-aware routing both use, so a gateway finds a prompt's blocks in what an engine reports."""

from __future__ import annotations

import hashlib
from array import array


def hash_key(kv_cache_dtype: str, adapter: str = "") -> bytes:
    """The first block's key: the cache's dtype, and the adapter the K/V were computed with (a LoRA
    changes every layer's K and V, so no block is shared across adapters)."""
    if not adapter:
        return kv_cache_dtype.encode()
    return hashlib.blake2b(f"{kv_cache_dtype}\0{adapter}".encode(), digest_size=16).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: list[int], block_size: int, num_blocks: int, kv_cache_dtype: str = "",
    adapter: str = "",
) -> None:
    """Append to `hashes` the hashes of full blocks len(hashes) to num_blocks - 1 of token_ids.

    Each hash covers its block's tokens and, through its parent's hash, every token before them.
    A 128-bit cryptographic hash: a crafted collision would hand one user's cached K/V to another.
    The first is keyed by the dtype of the cache that holds the blocks ("bfloat16", "int8", ...): a
    block's K/V differ by dtype, so a gateway never takes one engine's blocks for another's; and by
    the request's adapter, if any (hash_key).
    """
    while len(hashes) < num_blocks:
        start = len(hashes) * block_size
        block = array("q", token_ids[start : start + block_size]).tobytes()
        key = hashes[-1] if hashes else hash_key(kv_cache_dtype, adapter)
        hashes.append(hashlib.blake2b(block, digest_size=16, key=key).digest())


def prompt_block_hashes(prompt_ids: list[int], block_size: int, kv_cache_dtype: str = "", adapter: str = "") -> list[bytes]:
    """The hashes of the prompt blocks an engine may take from its cache: every full block but one
    holding the last prompt token, which is always computed (its logits sample the first token)."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt_ids, block_size, (len(prompt_ids) - 1) // block_size, kv_cache_dtype, adapter)
    return hashes
