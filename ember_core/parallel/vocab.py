"""A vocabulary split across tensor-parallel ranks: each holds an equal run of the embedding's and
the head's rows (the last rank's padded with zero rows), looks up the tokens that fall in its run,
and the ranks' lookups are summed; the head's logits are put side by side and the padding cut."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember_core.parallel.group import TensorParallel
from ember_core.parallel.sliceable import Sliceable, shape_of


@dataclass(frozen=True)
class VocabSplit:
    vocab_size: int  # the whole vocabulary's
    parallel: TensorParallel

    @property
    def local_size(self) -> int:
        return -(-self.vocab_size // self.parallel.world_size)

    @property
    def start(self) -> int:
        return self.parallel.rank * self.local_size

    def rows(self, source: Sliceable) -> torch.Tensor:
        """This rank's rows of an embedding or head matrix, padded to local_size."""
        rows = source[self.start : min(self.start + self.local_size, shape_of(source)[0])]
        padding = self.local_size - rows.shape[0]
        return torch.cat([rows, rows.new_zeros(padding, *rows.shape[1:])]) if padding else rows

    def embedded(self, embedding: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.start
        elsewhere = (local_ids < 0) | (local_ids >= self.local_size)
        hidden = embedding(local_ids.clamp(0, self.local_size - 1)).masked_fill_(elsewhere[:, None], 0)
        return self.parallel.sum(hidden)

    def logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        return self.parallel.concat(local_logits)[:, : self.vocab_size]
