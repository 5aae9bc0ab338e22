"""llama.cpp GGUF files: config from the metadata, weights dequantized into ember's decoder (or kept
in their blocks), tokenizer from the vocab."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from torch import nn

from ember_core.auto_dtype import DtypeChoice, resolved_dtype
from ember_core.config import Numerics
from ember_core.kernels import cpu_ops
from ember_core.layers.huge_pages import blocks_on_huge_pages
from ember_core.layers.linear import GGUF_BLOCK_FORMATS, SIXTEEN_BIT_KINDS
from ember_core.loaders.gguf_blocks import keep_gguf_blocks
from ember_core.loaders.gguf_config import decoder_config_from_gguf
from ember_core.loaders.gguf_tensors import iter_gguf_weights, model_tensors
from ember_core.loaders.materialize import materialize
from ember_core.models.decoder import Decoder
from ember_core.numerics import ResolvedNumerics, resolve_numerics
from ember_core.parallel.group import TensorParallel
from ember_core.parallel.shards import DecoderShards
from ember_core.tokenizer import Tokenizer, tokenizer_from_gguf

logger = logging.getLogger(__name__)


class FastGGUFReader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of the file's memory map. Every slice of a
    np.memmap is a memmap, whose bookkeeping made parsing SmolLM2's metadata (its ~98,000
    vocabulary and merge strings) take 5.2 s instead of 1.1; the values are the same."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._plain_data = value.view(np.ndarray)  # the view keeps the map open


def load_gguf(
    path: Path,
    device: torch.device,
    dtype: DtypeChoice,
    keep_blocks: bool = True,
    numerics: Numerics = "exact",
    parallel: TensorParallel | None = None,
) -> tuple[nn.Module, Tokenizer | None, ResolvedNumerics]:
    """`keep_blocks`: in float32 or bfloat16 on CPU, run Q4_0 to Q8_0, Q2_K to Q6_K, IQ4_NL and IQ4_XS
    weights from their blocks (gguf_blocks.py). `numerics` "auto" is "fast" where the file's linears
    are quantized and kept in their blocks; returned resolved. `parallel`: load this tensor-parallel
    rank's part (parallel/shards.py); a part whose columns cut the file's blocks keeps its values."""
    try:
        reader = FastGGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as exc:  # what gguf's parser raises on bad bytes
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from None
    config = decoder_config_from_gguf(reader)
    tensors = model_tensors(reader.tensors, config)
    take = None if parallel is None else DecoderShards(config, parallel).take
    tokenizer = tokenizer_from_gguf(reader)
    keeps_blocks = keep_blocks and device.type == "cpu" and cpu_ops.is_available()
    runs_blocks = keeps_blocks and _holds_quantized_weights(tensors)
    numerics = resolve_numerics(numerics, runs_blocks, device, dtype)
    dtype = resolved_dtype(dtype, numerics, "gguf-blocks" if runs_blocks else "dense")
    # llama.cpp's converter stores Gemma's norms as the (1 + w) they multiply by.
    weights = iter_gguf_weights(tensors, config, dtype, take)
    model = materialize(lambda: Decoder(config, parallel), weights, device, dtype, norm_offset=0.0)
    if keeps_blocks and dtype in (torch.float32, torch.bfloat16):
        replaced = keep_gguf_blocks(model, tensors)
        moved = blocks_on_huge_pages(model)
        logger.info("%d linear and embedding layers run from their GGUF blocks (%.0f MiB of them moved to a mapping "
                    "advised 2 MiB pages)", replaced, moved / 2**20)
    return model, tokenizer, numerics


def _holds_quantized_weights(tensors: list[ReaderTensor]) -> bool:
    """Whether a weight matrix of the file is in a block format the kernels read (not 16-bit rows)."""
    return any(t.tensor_type in GGUF_BLOCK_FORMATS and t.tensor_type not in SIXTEEN_BIT_KINDS.values() for t in tensors)

