"""One entry point from a model name to a ready model on its device."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember_core.layers.sixteen_bit_weights import keep_16_bit_weights
from ember_core.loaders.hf import iter_hf_weights, read_hf_config
from ember_core.loaders.resolve import resolve_model
from ember_core.models.registry import model_from_hf_config
from ember_core.tokenizer import Tokenizer, load_hf_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: nn.Module
    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    stop_token_ids: frozenset[int]  # EOS and end-of-turn ids
    dtype: torch.dtype


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


DtypeChoice = torch.dtype | Callable[[nn.Module], torch.dtype]


def chosen_dtype(dtype: DtypeChoice, build: Any) -> torch.dtype:
    """`dtype`, or what it picks for the model `build` makes, built without weights (meta device)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    with torch.device("meta"), _without_weight_init():
        model = build()
    return dtype(model)


def materialize(build: Any, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build the module without allocating random weights, then fill it from the checkpoint."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), _without_weight_init():
            model = build()
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.load_weights(weights)
    return model.eval()


def _load_hf(model_dir: Path, device: torch.device, dtype: DtypeChoice) -> tuple[nn.Module, Tokenizer | None]:
    hf_config = read_hf_config(model_dir)
    dtype = chosen_dtype(dtype, lambda: model_from_hf_config(hf_config))
    model = materialize(lambda: model_from_hf_config(hf_config), iter_hf_weights(model_dir), device, dtype)
    return model, load_hf_tokenizer(model_dir)


def load_model(name: str, device: torch.device, dtype: DtypeChoice, compact_weights: bool = True) -> LoadedModel:
    """`dtype`: a dtype, or a function that picks one for the model built without weights
    (dtype_probe.faster_cpu_dtype). `compact_weights`: keep GGUF blocks and 16-bit weights as stored
    (EngineConfig.gguf_weights == "blocks")."""
    path = resolve_model(name)
    if path.suffix == ".gguf":
        from ember_core.loaders.gguf_loader import load_gguf

        model, tokenizer = load_gguf(path, device, dtype, compact_weights)
    else:
        model, tokenizer = _load_hf(path, device, dtype)
    if compact_weights and (kept := keep_16_bit_weights(model)):
        logger.info("%d linear and embedding layers run from their 16-bit rows", kept)
    config = model.config
    dtype = next(param.dtype for param in model.parameters() if param.is_floating_point())
    stop_ids = set(config.eos_token_ids)
    if tokenizer is not None:
        stop_ids |= tokenizer.stop_token_ids
    logger.info("loaded %s (%s) on %s as %s", name, type(model).__name__, device, dtype)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        max_model_len=config.max_position_embeddings,
        vocab_size=config.vocab_size,
        stop_token_ids=frozenset(stop_ids),
        dtype=dtype,
    )
