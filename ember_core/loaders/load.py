"""One entry point from a model name to a ready model on its device."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ember_core.auto_dtype import DtypeChoice, resolved_dtype
from ember_core.config import Numerics
from ember_core.kernels import cpu_ops
from ember_core.layers.int8_weights import use_int8_arithmetic
from ember_core.layers.sixteen_bit_weights import keep_16_bit_weights
from ember_core.loaders.gguf_loader import load_gguf
from ember_core.loaders.hf import iter_hf_weights, read_hf_config
from ember_core.loaders.materialize import materialize
from ember_core.loaders.resolve import resolve_model
from ember_core.models.registry import config_from_hf, model_for, shards_for
from ember_core.numerics import ResolvedNumerics, resolve_numerics
from ember_core.parallel.group import TensorParallel
from ember_core.pooling import PoolingConfig, read_pooling_config
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
    pooling: PoolingConfig
    numerics: ResolvedNumerics = "exact"
    cpu_build: str = ""  # the CPU kernels' build (cpu_ops.build_in_use()); "" on another device


def _load_hf(
    model_dir: Path, device: torch.device, dtype: torch.dtype, parallel: TensorParallel | None
) -> tuple[nn.Module, Tokenizer | None]:
    config = config_from_hf(read_hf_config(model_dir))
    take = None if parallel is None else shards_for(config, parallel).take
    model = materialize(lambda: model_for(config, parallel), iter_hf_weights(model_dir, take), device, dtype)
    return model, load_hf_tokenizer(model_dir)


def load_model(
    name: str,
    device: torch.device,
    dtype: DtypeChoice,
    compact_weights: bool = True,
    numerics: Numerics = "exact",
    parallel: TensorParallel | None = None,
) -> LoadedModel:
    """`dtype`: a dtype, or "auto" on a CPU (ember_core/auto_dtype.py's table decides). `compact_weights`: keep GGUF blocks and 16-bit weights as stored
    (EngineConfig.gguf_weights == "blocks"). `numerics`: ember_core/numerics.py. `parallel`: load
    this tensor-parallel rank's part of the model (parallel/shards.py)."""
    path = resolve_model(name)
    if path.suffix == ".gguf":
        model, tokenizer, numerics = load_gguf(path, device, dtype, compact_weights, numerics, parallel)
        pooling = read_pooling_config(None, {}, model.config.pooling)
    else:
        numerics = resolve_numerics(numerics, False, device, dtype)
        model, tokenizer = _load_hf(path, device, resolved_dtype(dtype, numerics, "dense"), parallel)
        pooling = read_pooling_config(path, read_hf_config(path))
    if compact_weights and (kept := keep_16_bit_weights(model)):
        logger.info("%d linear and embedding layers run from their 16-bit rows", kept)
    if numerics == "fast":
        switched = use_int8_arithmetic(model)
        logger.info("numerics fast: %d linears and expert stacks multiply int8 activations", switched)
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
        pooling=pooling,
        numerics=numerics,
        cpu_build=cpu_ops.build_in_use() if device.type == "cpu" else "",
    )
