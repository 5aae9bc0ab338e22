"""blocks_on_huge_pages: a model's uint8 blocks copied into one mapping advised MADV_HUGEPAGE."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from torch import nn

from ember_core.layers.huge_pages import HUGE_PAGE_BYTES, blocks_on_huge_pages


class _Holder(nn.Module):
    def __init__(self, blocks: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.register_buffer("scale", scale)


def _model() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (300, 34), dtype=torch.uint8, generator=generator)  # a tied head's and embedding's
    model = nn.Module()
    model.head = _Holder(shared, torch.randn(3))
    model.embedding = _Holder(shared, torch.randn(3))
    model.layer = _Holder(torch.randint(0, 256, (3000, 1001), dtype=torch.uint8, generator=generator), torch.randn(5))
    return model


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "VmFlags:":
            return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="this platform's mmap has no MADV_HUGEPAGE (not Linux)")
def test_blocks_move_to_one_advised_mapping_with_their_values_and_sharing() -> None:
    model = _model()
    before = {name: buffer.clone() for name, buffer in model.named_buffers(remove_duplicate=False)}
    floats = {name: buffer for name, buffer in model.named_buffers(remove_duplicate=False) if buffer.dtype != torch.uint8}

    moved = blocks_on_huge_pages(model)

    assert moved == 300 * 34 // 64 * 64 + 64 + 3000 * 1001 // 64 * 64 + 64  # each tensor rounded up to 64 bytes
    for name, buffer in model.named_buffers(remove_duplicate=False):
        assert torch.equal(buffer, before[name]), name
        if name in floats:
            assert buffer is floats[name], f"{name}: only uint8 buffers move"
    head, embedding, layer = model.head.blocks, model.embedding.blocks, model.layer.blocks
    assert head is embedding, "a shared tensor stays one tensor"
    assert head.data_ptr() % HUGE_PAGE_BYTES == 0 and layer.data_ptr() % 64 == 0
    assert layer.data_ptr() - head.data_ptr() == 300 * 34 // 64 * 64 + 64
    assert head.is_contiguous() and layer.is_contiguous() and layer.shape == (3000, 1001)
    if sys.platform == "linux":
        assert "hg" in _vm_flags(layer.data_ptr()), "the mapping is advised MADV_HUGEPAGE"


def test_a_model_without_blocks_is_left_as_it_is() -> None:
    model = nn.Linear(4, 4)
    weight = model.weight
    assert blocks_on_huge_pages(model) == 0
    assert model.weight is weight
