"""An RMSNorm over a vector split across tensor-parallel ranks (OLMo 2's q and k norms, which
normalize a token's whole projection, all heads at once): each rank adds its columns' squares, the
ranks' sums are added in rank order, and each rank scales its columns by its slice of the weight."""

from __future__ import annotations

import torch

from ember_core.models.norm import RMSNorm
from ember_core.parallel.group import TensorParallel


class SplitRMSNorm(RMSNorm):
    def __init__(self, size: int, eps: float, parallel: TensorParallel, whole_size: int, counted: bool) -> None:
        """size: this rank's columns; whole_size: the vector's, across ranks. counted: whether this
        rank's squares go into the sum (False where its columns copy another rank's, as K/V heads
        replicated over more ranks than there are heads)."""
        super().__init__(size, eps)
        self.parallel, self.whole_size, self.counted = parallel, whole_size, counted

    def forward_(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, 1, size] normalized in place; returns x."""
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        total = self.parallel.sum(squares if self.counted else torch.zeros_like(squares))
        normalized = x32 * torch.rsqrt(total / self.whole_size + self.eps)
        return x.copy_(self.weight * normalized.to(x.dtype))
