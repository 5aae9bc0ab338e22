"""Low-rank adapters over a linear, a different one per row of the batch (S-LoRA and Punica's way):
y = base(x) + scale_a * (x A_a^T) B_a^T for the adapter a of each row, and base(x) alone for a
row of none.

An adapter that runs has a slot (lora/slots.py): its A and B sit in slot-indexed stacks of the
linear, zero past the adapter's rank, so giving it a slot copies into them and nothing is
reallocated. Both are stored transposed, A per part ([slots, parts, in, rank]) and B as [slots,
rank, out], so that the kernel sums ranks and outputs side by side. A fused linear (QKV, gate/up)
keeps each part's A apart and its B in the part's columns, so one call serves the parts, and a part
the adapter leaves alone has rank 0 there. An adapter has one scale (alpha / rank), kept per slot.

Every row's delta is summed in float32, whatever the dtype of the model and of the adapters (the
model's by default, or bfloat16: --lora-dtype); a bfloat16 model's sum is rounded once. On CPU one
C++ call adds a linear's rows of every adapter (kernels/lora.cpp), each sum in a fixed order, so a
row keeps its bits whatever shares the step; elsewhere each adapter's rows are gathered and
multiplied on their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ember_core.kernels import cpu_ops


@dataclass(frozen=True)
class AdapterTarget:
    """A linear an adapter may adapt, as a model names it: parent.attribute, and each of its parts'
    module name in the checkpoint (PEFT's: "model.layers.0.self_attn.q_proj") and output rows."""

    parent: nn.Module
    attribute: str
    parts: list[tuple[str, int]]


class AdapterRows:
    """Each row's adapter slot for the step (-1: none), shared by every LoRALinear of a model: set by
    the runner before the forward."""

    def __init__(self, max_loras: int) -> None:
        self.slots: torch.Tensor | None = None  # int64 [rows]
        self.active = False  # some row runs with an adapter
        self.scales = [0.0] * max_loras  # each slot's adapter's

    def set(self, slots: list[int], device: torch.device) -> None:
        self.active = any(slot >= 0 for slot in slots)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device) if self.active else None

    @contextlib.contextmanager
    def selecting(self, rows: list[int]) -> Iterator[None]:
        """Within: the slots of `rows` only, for a linear that runs on those rows of the step (the
        output head on the rows that sample)."""
        slots, active = self.slots, self.active
        if slots is not None:
            self.slots = slots[rows]
            self.active = bool((self.slots >= 0).any())
        try:
            yield
        finally:
            self.slots, self.active = slots, active

    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, its rows) for each adapter present: the torch path's gathers."""
        assert self.slots is not None
        return [(int(slot), (self.slots == slot).nonzero().flatten()) for slot in self.slots.unique() if slot >= 0]


class LoRALinear(nn.Module):
    """A linear and the adapters over it. parts: the output rows of each part of a fused linear."""

    def __init__(
        self, base: nn.Module, parts: list[int], rows: AdapterRows, max_loras: int, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts, self.max_rank, self.rows = parts, max_rank, rows
        shape_a = (max_loras, len(parts), self.in_features, max_rank)
        self.register_buffer("lora_a", torch.zeros(shape_a, dtype=dtype, device=device))  # A^T per part
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, self.out_features, dtype=dtype, device=device))  # B^T
        self.ranks = torch.zeros(max_loras, len(parts), dtype=torch.long)  # per slot, each part's adapter rank

    def set_adapter(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """weights: each part's (A [r, in], B [part rows, r]), None where the adapter leaves it."""
        self.clear(slot)
        row = 0
        for index, (part_rows, part) in enumerate(zip(self.parts, weights)):
            if part is not None:
                a, b = part
                rank = a.shape[0]
                self.lora_a[slot, index, :, :rank] = a.T
                self.lora_b[slot, :rank, row : row + part_rows] = b.T
                self.ranks[slot, index] = rank
            row += part_rows

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.ranks[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.rows.active:
            return y
        if x.device.type == "cpu" and cpu_ops.is_available():
            cpu_ops.ops().lora_add_(
                y, x.contiguous(), self.lora_a, self.lora_b, self.rows.slots, self.rows.scales, self.parts, self.ranks
            )
            return y
        for slot, rows in self.rows.groups():
            x_rows, start = x.index_select(0, rows).float(), 0
            delta = torch.zeros(len(rows), y.shape[1], device=x.device)
            for part, part_rows in enumerate(self.parts):
                columns = slice(start, start + part_rows)
                delta[:, columns] = (x_rows @ self.lora_a[slot, part].float()) @ self.lora_b[slot, :, columns].float()
                start += part_rows
            y.index_add_(0, rows, delta.mul_(self.rows.scales[slot]).to(y.dtype))
        return y
