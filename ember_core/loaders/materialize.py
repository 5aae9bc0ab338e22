"""A model built without allocating random weights, then filled from its checkpoint, in the dtype
chosen for it (HF and GGUF loaders alike)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

# What torch's layers call in reset_parameters.
_WEIGHT_INITS = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_", "constant_", "trunc_normal_")


@contextlib.contextmanager
def _without_weight_init() -> Iterator[None]:
    """The layers' random init is skipped: the checkpoint overwrites every weight, and on the meta
    device torch runs that init through decompositions that import torch._dynamo, ~2 s of every
    engine start."""
    originals = {name: getattr(nn.init, name) for name in _WEIGHT_INITS}
    for name in _WEIGHT_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, init in originals.items():
            setattr(nn.init, name, init)


def materialize(
    build: Any, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device, dtype: torch.dtype, **load_options: Any
) -> nn.Module:
    """Build the module without allocating random weights, then fill it from the checkpoint
    (`load_options` go to its load_weights)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), _without_weight_init():
            model = build()
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.load_weights(weights, **load_options)
    return model.eval()
