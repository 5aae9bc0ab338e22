"""GGUF tensors -> HF tensors of the file's family: dequantize, restore the shape, rename, undo
llama.cpp's q/k row order (llama architecture)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from tqdm.auto import tqdm

from ember_core.loaders.hf import Take
from ember_core.models.decoder_config import DecoderConfig
from ember_core.models.family import Family, NormSlot

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's norm tensors by the slot they fill (the checkpoint's name for it depends on the family).
NORM_TENSORS: dict[str, NormSlot] = {
    "attn_norm": "attn_in",
    "post_attention_norm": "attn_out",
    "ffn_norm": "mlp_in",
    "post_ffw_norm": "mlp_out",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one tensor
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A Gated DeltaNet layer's tensors (llama.cpp's qwen35): its input projections, convolution, decay
# (ssm_a: -exp(A_log)), dt bias, gated norm and output projection.
LINEAR_ATTENTION_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
}
# Its two vectors stored without the checkpoint's kind: blk.N.ssm_a, blk.N.ssm_dt.bias.
LINEAR_ATTENTION_VECTORS = {"ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias"}
# LFM2's short convolution (llama.cpp's lfm2).
SHORT_CONV_NAMES = {"shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv", "shortconv.out_proj": "conv.out_proj"}
# A Mamba2 layer's (llama.cpp's granitehybrid): A as -exp(A_log) and D as [heads, 1], the gated
# norm's weight per group.
MAMBA2_NAMES = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm", "ssm_out": "mamba.out_proj"}
MAMBA2_VECTORS = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt": "mamba.dt_bias"}
# Per recurrent mixer: its module tensors and its vectors stored without the checkpoint's kind.
RECURRENT_NAMES = {
    "gated_delta_net": (LINEAR_ATTENTION_NAMES, LINEAR_ATTENTION_VECTORS),
    "short_conv": (SHORT_CONV_NAMES, {}),
    "mamba2": (MAMBA2_NAMES, MAMBA2_VECTORS),
}
# Vectors GGUF files store with a second dimension.
_FLATTENED = (".A_log", ".D", ".mamba.norm.weight")
# A sparse layer's experts, stacked [experts, rows, columns]: each expert's gate, up, down projection.
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# RoPE tables, read into the config, not weights.
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
NOT_WEIGHTS = (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")


def hf_name(gguf_name: str, family: Family) -> str:
    """The checkpoint's name of a GGUF tensor, as the family's checkpoints spell it."""
    name = _llama_like_name(gguf_name, family)
    if not name.startswith("model."):  # lm_head
        return name
    return "model." + family.checkpoint_name(name.removeprefix("model."))


def _llama_like_name(gguf_name: str, family: Family) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base == family.gguf_output_norm:
        return f"model.norm.{kind}"
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{kind}"
    match = LAYER_TENSOR.fullmatch(gguf_name)
    name = None
    if match is not None:
        tensor = match[2]
        mixer_names, mixer_vectors = RECURRENT_NAMES[family.mixer] if family.linear_attention else ({}, {})
        if tensor in mixer_vectors:
            return f"model.layers.{match[1]}.{mixer_vectors[tensor]}"
        if tensor in mixer_names:
            name = mixer_names[tensor]
        elif tensor == "post_attention_norm":
            name = family.norm_name(family.gguf_post_attention_norm)
        elif tensor in NORM_TENSORS:
            name = family.norm_name(NORM_TENSORS[tensor])
        elif tensor == "ffn_up":  # Phi-3's holds the gate's rows and the up projection's
            name = "mlp.gate_up_proj" if family.fused_checkpoint else "mlp.up_proj"
        elif family.experts is not None and tensor == "ffn_gate_inp":
            name = f"{family.experts.block}.gate"
        elif family.experts is not None and tensor in EXPERT_TENSORS:
            name = f"{family.experts.block}.experts.{family.experts.projections[EXPERT_TENSORS.index(tensor)]}"
        else:
            name = LAYER_NAMES.get(tensor)
    if name is None or match[3] is None:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a {family.name} GGUF file")
    return f"model.layers.{match[1]}.{name}.{match[3]}"


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


def in_hf_row_order(hf_tensor_name: str, rows: torch.Tensor, config: DecoderConfig) -> torch.Tensor:
    """A GGUF tensor's rows (values or quantized blocks) in the HF order of the tensor it becomes."""
    if not config.family.gguf_permuted_qk:
        return rows
    if ".self_attn.q_proj." in hf_tensor_name:
        return unpermute_rotary_rows(rows, config.num_heads)
    if ".self_attn.k_proj." in hf_tensor_name:
        return unpermute_rotary_rows(rows, config.num_kv_heads)
    return rows


def model_tensors(tensors: list[ReaderTensor], config: DecoderConfig) -> list[ReaderTensor]:
    """The tensors of the layers ember runs: not those of a multi-token-prediction block, which
    llama.cpp's converter appends after the model's layers (nextn_predict_layers)."""
    kept = []
    for tensor in tensors:
        match = LAYER_TENSOR.fullmatch(tensor.name)
        if match is None or int(match[1]) < config.num_layers:
            kept.append(tensor)
    return kept


def iter_gguf_weights(
    tensors: list[ReaderTensor], config: DecoderConfig, dtype: torch.dtype, take: Take | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight by its HF name; with `take` (a tensor-parallel rank's, parallel/shards.py), only
    the part it takes."""
    for tensor in tqdm(tensors, desc="loading GGUF", unit="tensor"):
        if tensor.name in NOT_WEIGHTS:
            continue
        name = hf_name(tensor.name, config.family)
        values = in_hf_row_order(name, dequantize(tensor), config)
        if name.endswith(".A_log"):  # the file holds the decay rate -exp(A_log)
            values = torch.log(-values)
        if name.endswith(_FLATTENED):
            values = values.reshape(-1)
        elif name.endswith((".conv1d.weight", ".conv.conv.weight")):  # [channels, kernel], Conv1d's [channels, 1, kernel]
            values = values.unsqueeze(1)
        if ".experts." in name:  # one checkpoint tensor per expert, as Hugging Face stores them
            parts = [(name.replace(".experts.", f".experts.{expert}."), part) for expert, part in enumerate(values)]
        elif name.endswith("shared_expert_gate.weight"):  # llama.cpp stores its one row as a vector
            parts = [(name, values.reshape(1, -1))]
        else:
            parts = [(name, values)]
        for part_name, part in parts:
            yield part_name, (part if take is None else take(part_name, part)).to(dtype)
