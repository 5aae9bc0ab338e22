"""How many KV blocks an engine allocates and how long one sequence may then be: sized at start,
and refused at start where the device or the model cannot hold it."""

from __future__ import annotations

import logging

import torch

from ember_core.config import EngineConfig
from ember_core.device import available_memory

logger = logging.getLogger(__name__)


def pool_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device, state_bytes: int = 0) -> int:
    """--num-blocks, or as many blocks as --kv-cache-mib holds beside state_bytes (a hybrid model's
    state pool, which the same budget holds first)."""
    num_blocks = config.num_blocks
    if num_blocks is None:
        num_blocks = (int(config.kv_cache_mib * 2**20) - state_bytes) // bytes_per_block
        if num_blocks == 0:
            raise ValueError(
                f"a KV cache of {config.kv_cache_mib:g} MiB holds no block of {config.block_size} tokens "
                f"({bytes_per_block / 2**20:.1f} MiB each): raise --kv-cache-mib or lower --block-size"
            )
    _check_fits(num_blocks * bytes_per_block + state_bytes, device)
    return num_blocks


def _check_fits(pool_bytes: int, device: torch.device) -> None:
    """Refuse at start a KV pool the device's free memory cannot hold, rather than letting the
    allocation fail, or on Linux swap and draw the OOM killer onto the whole host."""
    available = available_memory(device)
    if available is not None and pool_bytes > available:
        raise ValueError(
            f"the KV cache needs {pool_bytes / 2**30:.2f} GiB but {device.type} has {available / 2**30:.2f} GiB "
            "free: lower --kv-cache-mib / --num-blocks"
        )


def max_model_len(model_limit: int, requested: int | None, cache_tokens: int) -> int:
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
