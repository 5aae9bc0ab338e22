"""The ranks of one tensor-parallel model and the collectives its layers call.

Sums across ranks go through an all-gather and add the parts in rank order on every rank, not
through the backend's all-reduce, whose order of addition is its own (gloo's ring differs with the
tensor's size): every rank gets the same bits, the same every run, whatever else shares the step.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ember_core.parallel.rank_lost import RankLost
from ember_core.parallel.shared_exchange import SharedExchange

# A worker rank waits in a collective while its engine is idle: no timeout but a dead peer's
# closed connection, which gloo reports at once.
_IDLE_WAIT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world_size: int
    # Ranks on one host gather through shared memory (shared_exchange.py); others through gloo.
    exchange: SharedExchange | None = field(default=None, compare=False)

    @property
    def is_leader(self) -> bool:
        """Rank 0: it schedules, samples and speaks to the gateways; the others follow its steps."""
        return self.rank == 0

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x added in rank order, on every rank."""
        parts = self._gathered(x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def concat(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x side by side along the last dimension, on every rank."""
        return torch.cat(self._gathered(x), dim=-1)

    def _gathered(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.exchange is not None and (shared := self.exchange.gather(x)) is not None:
            return shared
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, x.contiguous())
        except RuntimeError as exc:  # gloo: a peer's connection closed
            raise RankLost(f"a tensor-parallel rank is gone: {exc}") from exc
        return parts

    def broadcast(self, value: Any = None) -> Any:
        """The leader's value (a picklable object), on every rank."""
        box = [value]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as exc:
            raise RankLost(f"a tensor-parallel rank is gone: {exc}") from exc
        return box[0]


def join(rank: int, world_size: int, address: str) -> TensorParallel:
    """Join the process group at address (host:port, the leader's) as rank, over gloo."""
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world_size, timeout=_IDLE_WAIT)
    return TensorParallel(rank, world_size)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
