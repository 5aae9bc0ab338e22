"""A tensor-parallel follower rank: its part of the model, and the leader's steps run over it."""

from __future__ import annotations

import ctypes
import logging
import signal
from dataclasses import dataclass, replace

import torch

from ember_core.config import EngineConfig
from ember_core.device import resolve_device
from ember_core.loaders import load_model
from ember_core.parallel.group import join, leave
from ember_core.parallel.rank_lost import RankLost
from ember_core.parallel.shared_exchange import SharedExchange
from ember_core.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSetup:
    """What the leader decided at load, which its followers must share."""

    dtype: torch.dtype
    numerics: str
    num_blocks: int
    kv_cache_dtype: torch.dtype


def follow(config: EngineConfig, rank: int, world_size: int, address: str, threads: int | None = None) -> None:
    """A follower rank: load this rank's part of the model as the leader's setup says, then run
    every step the leader sends until it sends None. threads: its share of the host's cores, when
    it shares the host with other ranks."""
    _exit_with_parent()
    if threads is not None:
        torch.set_num_threads(threads)
    parallel = join(rank, world_size, address)
    exchange = None
    try:
        if threads is not None:  # started by a leader on this host: gather through shared memory
            exchange = SharedExchange(rank, world_size, parallel.broadcast())
            parallel = replace(parallel, exchange=exchange)
        setup: RankSetup | None = parallel.broadcast()
        if setup is None:  # the leader could not load the model
            return
        device = resolve_device(config.device)
        loaded = load_model(
            config.model, device, setup.dtype, compact_weights=config.gguf_weights == "blocks", numerics=setup.numerics,
            parallel=parallel,
        )
        runner = ModelRunner(loaded.model, setup.num_blocks, config.block_size, setup.kv_cache_dtype, config.decode_attention, parallel)
        while (chunks := parallel.broadcast()) is not None:
            runner.follow(chunks)
    except RankLost as exc:
        logger.error("tensor-parallel rank %d stops: %s", rank, exc)
        raise SystemExit(1) from None
    finally:
        leave()
        if exchange is not None:
            exchange.close()


def _exit_with_parent() -> None:
    """A follower dies with the process that started it, however that one ends (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
