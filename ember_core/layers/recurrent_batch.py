"""Which state slot each sequence of a step reads and updates: the recurrent layers' counterpart of
the block tables (a hybrid model's linear-attention layers keep one fixed-size state per sequence)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentBatch:
    """The step's sequences in batch order: their tokens are rows starts[i]:starts[i + 1]."""

    starts: torch.Tensor  # [sequences + 1] int64
    slots: torch.Tensor  # [sequences] int64: each sequence's slot in the state pool
    fresh: torch.Tensor  # [sequences] bool: the chunk begins the sequence, its states start at zero

    @classmethod
    def of(cls, num_tokens: list[int], slots: list[int], fresh: list[bool], device: torch.device) -> RecurrentBatch:
        starts = [0]
        for count in num_tokens:
            starts.append(starts[-1] + count)
        return cls(
            torch.tensor(starts, dtype=torch.long, device=device),
            torch.tensor(slots, dtype=torch.long, device=device),
            torch.tensor(fresh, dtype=torch.bool, device=device),
        )
