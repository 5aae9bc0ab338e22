"""ember's LoRA delta op (ember_core/kernels/lora.cpp) against the float64 product it computes: rows
of several adapters and of none in one call, a fused linear's parts each in its band, adapters of
lower rank than the band; a row's bits do not depend on the rows beside it, in float32 and bfloat16;
and the torch fallback of LoRALinear (other devices) agrees."""

from __future__ import annotations

import pytest
import torch

from ember_core.kernels import cpu_ops
from ember_core.layers.lora import AdapterRows, LoRALinear

pytestmark = pytest.mark.usefixtures("kernel")

# An odd IN (its last term summed alone), parts and ranks that take every width of the kernel's sums
# (16 or 32 lanes, 8, 1) and a part past one 64-output tile.
IN, PARTS, BAND, SLOTS = 73, [100, 24, 37], 20, 3


def _stacks(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    """Slot 0: ranks 20, 16 and 20; slot 1: 3 on the first part and 11 on the last; slot 2: empty. A is
    transposed per part ([slots, parts, in, band]), B transposed ([slots, band, out])."""
    a_t, b_t = torch.zeros(SLOTS, len(PARTS), IN, BAND), torch.zeros(SLOTS, BAND, sum(PARTS))
    ranks = torch.tensor([[20, 16, 20], [3, 0, 11], [0, 0, 0]])
    starts = [0, *torch.tensor(PARTS).cumsum(0).tolist()]
    for slot in range(SLOTS):
        for part, used in enumerate(ranks[slot].tolist()):
            a_t[slot, part, :, :used] = torch.randn(IN, used, generator=generator)
            b_t[slot, :used, starts[part] : starts[part + 1]] = torch.randn(used, PARTS[part], generator=generator)
    return a_t, b_t, ranks, [0.5, 2.0, 1.0]


def _exact(y: torch.Tensor, x: torch.Tensor, a_t, b_t, slots: torch.Tensor, scales: list[float]) -> torch.Tensor:
    out = y.double().clone()
    starts = [0, *torch.tensor(PARTS).cumsum(0).tolist()]
    for row, slot in enumerate(slots.tolist()):
        for part in range(len(PARTS)) if slot >= 0 else ():
            columns = slice(starts[part], starts[part + 1])
            out[row, columns] += scales[slot] * (x[row].double() @ a_t[slot, part].double()) @ b_t[slot, :, columns].double()
    return out


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])  # --lora-dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_adapters_delta_whatever_shares_the_call(dtype: torch.dtype, weights: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    a, b_t, ranks, scales = _stacks(generator)
    a, b_t = a.to(weights), b_t.to(weights)
    slots = torch.tensor([0, -1, 1, 0, 2, 1, 0, 0, -1, 1])
    x = torch.randn(len(slots), IN, generator=generator).to(dtype)
    y = torch.randn(len(slots), sum(PARTS), generator=generator).to(dtype)
    together = y.clone()
    cpu_ops.ops().lora_add_(together, x, a, b_t, slots, scales, PARTS, ranks)
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 5e-2}
    torch.testing.assert_close(together.double(), _exact(y, x, a, b_t, slots, scales), **tolerance)
    assert torch.equal(together[slots < 0], y[slots < 0])
    for row in range(len(slots)):
        alone = y[row : row + 1].clone()
        cpu_ops.ops().lora_add_(alone, x[row : row + 1].contiguous(), a, b_t, slots[row : row + 1].clone(), scales, PARTS, ranks)
        assert torch.equal(alone, together[row : row + 1]), row


def test_the_torch_fallback_agrees_with_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(4)
    base = torch.nn.Linear(IN, sum(PARTS), bias=False)
    rows = AdapterRows(SLOTS)
    linear = LoRALinear(base, PARTS, rows, SLOTS, BAND, torch.float32, torch.device("cpu"))
    for slot, rank in ((0, 8), (1, 3)):
        weights = [(torch.randn(rank, IN, generator=generator), torch.randn(p, rank, generator=generator)) for p in PARTS]
        linear.set_adapter(slot, weights)
        rows.scales[slot] = 0.5 + slot
    x = torch.randn(6, IN, generator=generator)
    rows.set([0, -1, 1, 1, 0, -1], x.device)
    with torch.no_grad():
        on_kernel = linear(x)
        monkeypatch.setattr(cpu_ops, "is_available", lambda: False)
        on_torch = linear(x)
    torch.testing.assert_close(on_kernel, on_torch, rtol=1e-5, atol=1e-5)
