"""GGUF tensors -> HF Llama tensors: dequantize, restore the shape, rename, undo llama.cpp's q/k row order."""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from tqdm.auto import tqdm

from ember_core.models.llama import LlamaConfig

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FREQS = "rope_freqs.weight"  # read into LlamaConfig.rope_freq_factors, not a weight
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{kind}"
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in LAYER_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"


def dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """Float32 values in PyTorch's [out, in] layout; any type gguf-py can dequantize."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-varying first (ggml's ne), the reverse of a row-major shape.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    # Unquantized tensors come back as read-only views of the memory-mapped file: copy those.
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(shape)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's `permute` of attn_q / attn_k (weights and biases).

    ggml's rope rotates adjacent pairs (2i, 2i+1), so the converter interleaves each head's rows:
    HF row i of the first half goes to 2i, row i of the second half to 2i + 1. HF's rotate_half
    pairs i with i + head_dim / 2; taking the rows back gives the same attention scores.
    """
    half_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half_dim, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def in_hf_row_order(hf_tensor_name: str, rows: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """A GGUF tensor's rows (values or quantized blocks) in the HF order of the tensor it becomes."""
    if ".self_attn.q_proj." in hf_tensor_name:
        return unpermute_rotary_rows(rows, config.num_heads)
    if ".self_attn.k_proj." in hf_tensor_name:
        return unpermute_rotary_rows(rows, config.num_kv_heads)
    return rows


def iter_gguf_weights(
    tensors: list[ReaderTensor], config: LlamaConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in tqdm(tensors, desc="loading GGUF", unit="tensor"):
        if tensor.name == ROPE_FREQS:
            continue
        name = hf_name(tensor.name)
        yield name, in_hf_row_order(name, dequantize(tensor), config).to(dtype)
