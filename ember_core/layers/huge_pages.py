"""A model's GGUF blocks moved into one memory mapping that Linux backs with 2 MiB pages
(transparent huge pages, asked for with madvise; the default `madvise` mode grants them, `never`
refuses and nothing changes but a copy).

A decode step reads every weight once, a few hundred MB. On 4 KiB pages each page of it costs a
TLB walk and stops the hardware prefetchers at its boundary; torch's and numpy's allocators give
ember's tensors such pages unless told otherwise. So the blocks are copied once, after loading,
into a mapping advised before its first touch: a one-stream decode step of a Qwen3.5-0.8B-shaped
Q4_K_M file took 45.8 ms instead of 48.6 (Sapphire Rapids VM, alternated runs, docs/benchmarks.md).
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 << 20
_TENSOR_ALIGNMENT = 64  # each tensor starts on a cache line, as the kernels' loads prefer


def _key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """One entry per distinct tensor: a tied head's and embedding's shared blocks stay shared."""
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def blocks_on_huge_pages(model: nn.Module) -> int:
    """Move every uint8 CPU buffer of `model` (its GGUF blocks) into one anonymous mapping advised
    MADV_HUGEPAGE, each module's buffer rebound to its copy; returns the bytes moved (0 where this
    Python's mmap has no MADV_HUGEPAGE, as off Linux). A tensor's old memory is freed as soon as
    its owners are rebound, so loading peaks at one tensor above the model's size, not twice it."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    owners: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[tuple[nn.Module, str]]] = {}
    sizes = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.dtype == torch.uint8 and buffer.device.type == "cpu" and buffer.numel() > 0:
                owners.setdefault(_key(buffer), []).append((module, name))
                sizes[_key(buffer)] = -(-buffer.numel() // _TENSOR_ALIGNMENT) * _TENSOR_ALIGNMENT
    total = sum(sizes.values())
    if total == 0:
        return 0
    region = mmap.mmap(-1, total + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` for as long as any view lives
    offset = -arena.data_ptr() % HUGE_PAGE_BYTES  # the first tensor on a 2 MiB boundary
    for key, holders in owners.items():
        module, name = holders[0]
        tensor = module._buffers[name]
        assert tensor is not None
        copy = arena[offset : offset + tensor.numel()].view(tensor.shape)
        copy.copy_(tensor)
        for module, name in holders:
            module._buffers[name] = copy
        offset += sizes[key]
    return total
