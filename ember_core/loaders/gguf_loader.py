"""llama.cpp GGUF files: config from the metadata, weights dequantized into ember's Llama, tokenizer from the vocab."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.loaders.gguf_blocks import keep_gguf_blocks
from ember_core.loaders.gguf_tensors import ROPE_FREQS, dequantize, iter_gguf_weights
from ember_core.loaders.materialize import DtypeChoice, chosen_dtype, materialize
from ember_core.models.llama import Llama, LlamaConfig
from ember_core.models.rotary import RopeScaling
from ember_core.tokenizer import Tokenizer, tokenizer_from_gguf

logger = logging.getLogger(__name__)

_REQUIRED = object()


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


def _metadata(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """A scalar or string metadata value."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file has no {key!r} metadata")
        return default
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key!r} is an array; ember expects one value")
    part = field.parts[field.data[0]]
    return part.tobytes().decode("utf-8") if field.types[0] == gguf.GGUFValueType.STRING else part[0].item()


def _rope_scaling(reader: gguf.GGUFReader) -> RopeScaling | None:
    kind = _metadata(reader, "llama.rope.scaling.type", None)
    if kind is None:
        scale_linear = _metadata(reader, "llama.rope.scale_linear", None)  # the key before rope.scaling.*
        return None if scale_linear in (None, 1.0) else RopeScaling("linear", float(scale_linear))
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(_metadata(reader, "llama.rope.scaling.factor")))
    raise ValueError(
        f"unsupported GGUF rope scaling type {kind!r}; ember supports 'none' and 'linear' (llama3 comes as rope_freqs)"
    )


def llama_config_from_gguf(reader: gguf.GGUFReader) -> LlamaConfig:
    architecture = _metadata(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; ember loads 'llama' GGUF files")
    if _metadata(reader, "llama.expert_count", 0):
        raise ValueError("mixture-of-experts llama GGUF files are not supported")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hidden = _metadata(reader, "llama.embedding_length")
    num_heads = _metadata(reader, "llama.attention.head_count")
    head_dim = _metadata(reader, "llama.attention.key_length", hidden // num_heads)
    rope_dims = _metadata(reader, "llama.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    vocab_size = _metadata(reader, "llama.vocab_size", None)
    if vocab_size is None:
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise ValueError("GGUF file has neither llama.vocab_size nor a tokenizer.ggml.tokens list")
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    freq_factors = tensors.get(ROPE_FREQS)
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=_metadata(reader, "llama.context_length"),
        hidden_size=hidden,
        num_layers=_metadata(reader, "llama.block_count"),
        num_heads=num_heads,
        num_kv_heads=_metadata(reader, "llama.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        intermediate_size=_metadata(reader, "llama.feed_forward_length"),
        rms_norm_eps=_metadata(reader, "llama.attention.layer_norm_rms_epsilon"),
        rope_theta=_metadata(reader, "llama.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(reader),
        rope_freq_factors=None if freq_factors is None else tuple(dequantize(freq_factors).tolist()),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        bos_token_id=_metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_metadata(reader, "tokenizer.ggml.eos_token_id", None),
    )


def load_gguf(
    path: Path, device: torch.device, dtype: DtypeChoice, keep_blocks: bool = True
) -> tuple[nn.Module, Tokenizer]:
    """`keep_blocks`: in float32 or bfloat16 on CPU, run Q4_0 to Q8_0, Q2_K to Q6_K, IQ4_NL and IQ4_XS
    weights from their blocks (gguf_blocks.py)."""
    try:
        reader = FastGGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as exc:  # what gguf's parser raises on bad bytes
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from None
    config = llama_config_from_gguf(reader)
    tokenizer = tokenizer_from_gguf(reader)
    dtype = chosen_dtype(dtype, lambda: Llama(config))
    model = materialize(lambda: Llama(config), iter_gguf_weights(reader.tensors, config, dtype), device, dtype)
    if keep_blocks and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_ops.is_available():
        replaced = keep_gguf_blocks(model, reader.tensors)
        logger.info("%d linear and embedding layers run from their GGUF blocks", replaced)
    return model, tokenizer
