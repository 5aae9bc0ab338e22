"""The processes of a tensor-parallel engine. The leader (rank 0) is the engine: it schedules,
samples and talks to the gateways; before each step it sends the step's chunks to the followers,
which run the same forward pass over their parts of the model and join its collectives.

On one host the leader starts its followers as child processes. Across hosts each node runs
`ember-engine` under torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): rank 0
serves, the others follow (services/ember_engine/cli.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
from dataclasses import replace

import torch

from ember_core.config import EngineConfig
from ember_core.parallel.follower import RankSetup, follow
from ember_core.parallel.group import join, leave
from ember_core.parallel.rank_lost import RankLost
from ember_core.parallel.shared_exchange import SharedExchange

logger = logging.getLogger(__name__)


def torchrun_rank() -> tuple[int, int, str] | None:
    """(rank, world size, leader address) from torchrun's environment, None outside it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), address


class LeaderRanks:
    """The leader's place in the group and, on one host, its followers, started as child processes
    (under torchrun they are started on their own nodes)."""

    def __init__(self, config: EngineConfig) -> None:
        world_size = config.tensor_parallel_size
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.threads_before = torch.get_num_threads()
        launched = torchrun_rank()
        if launched is not None:
            rank, launched_size, address = launched
            if (rank, launched_size) != (0, world_size):
                raise ValueError(f"torchrun started rank {rank} of {launched_size}; the leader is rank 0 of {world_size}")
        else:
            address = f"127.0.0.1:{free_port()}"
            # The host's cores shared out: ranks that each took them all would take turns on them.
            threads = max(1, torch.get_num_threads() // world_size)
            torch.set_num_threads(threads)
            context = multiprocessing.get_context("spawn")
            self.processes = [
                context.Process(
                    target=follow, args=(config, rank, world_size, address, threads), name=f"ember-rank-{rank}", daemon=True
                )
                for rank in range(1, world_size)
            ]
            for process in self.processes:
                process.start()
        self.parallel = join(0, world_size, address)
        if self.processes:  # all on this host: the collectives go through shared memory
            exchange = SharedExchange(0, world_size, peers_alive=lambda: all(p.is_alive() for p in self.processes))
            self.parallel.broadcast(exchange.name)
            self.parallel = replace(self.parallel, exchange=exchange)
        logger.info("tensor parallel: rank 0 of %d at %s, local followers %s", world_size, address, [p.pid for p in self.processes])

    def share(self, setup: RankSetup) -> None:
        self.parallel.broadcast(setup)

    def check(self) -> None:
        """RankLost when a follower has exited: the engine cannot step without it."""
        for process in self.processes:
            if not process.is_alive():
                raise RankLost(f"tensor-parallel rank {process.name} exited (code {process.exitcode})")

    def close(self) -> None:
        """Tell the followers to stop, and wait for them."""
        try:
            self.check()
            self.parallel.broadcast(None)
        except RankLost:
            pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        leave()
        if self.parallel.exchange is not None:
            self.parallel.exchange.close()
        torch.set_num_threads(self.threads_before)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
