"""Keep a GGUF file's quantized weights in their blocks: swap the loaded float32 Linears for
`GGUFBlockLinear`s over the file's Q4_1 / Q8_0 / Q4_K / Q6_K rows (fused QKV and gate/up stacked as at load)."""

from __future__ import annotations

import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from torch import nn

from ember_core.layers.linear import GGUF_BLOCK_FORMATS, SIXTEEN_BIT_KINDS, GGUFBlockLinear
from ember_core.loaders.gguf_tensors import ROPE_FREQS, hf_name, in_hf_row_order
from ember_core.models.llama import Llama


def _shard_names(model: Llama, module_name: str) -> list[str]:
    """The HF module names (no `model.` prefix) whose weights fill this Linear's rows, in order."""
    for fused, shards in model.fused_shards().items():
        if module_name.endswith(f".{fused}"):
            prefix = module_name.removesuffix(fused)
            return [prefix + shard for shard, _ in shards]
    if module_name == "lm_head" and model.config.tie_word_embeddings:
        return ["embed_tokens"]
    return [module_name]


def keep_gguf_blocks(model: Llama, tensors: list[ReaderTensor]) -> int:
    """Replace each Linear whose GGUF tensors all share one supported block format; returns how many.

    The model must already hold the dequantized weights: a Linear whose tensors mix formats (or
    use one the kernel does not read, such as Q5_K) keeps them. In a Q4_K_M file that is the fused
    QKV of the layers whose V is Q6_K.
    """
    by_module = {
        hf_name(t.name).removeprefix("model.").removesuffix(".weight"): t
        for t in tensors
        if t.name != ROPE_FREQS and t.name.endswith(".weight")
    }
    linears = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    replaced = 0
    for name, linear in linears:
        shards = [(shard, by_module[shard]) for shard in _shard_names(model, name)]
        kinds = {tensor.tensor_type for _, tensor in shards}
        kind = kinds.pop()
        if kinds or kind not in GGUF_BLOCK_FORMATS or kind in SIXTEEN_BIT_KINDS.values():
            continue  # 16-bit tensors are kept by keep_16_bit_weights, as any checkpoint's
        rows = [
            in_hf_row_order(f"{shard}.weight", torch.from_numpy(np.array(tensor.data)), model.config)
            for shard, tensor in shards
        ]
        blocks = torch.cat(rows).contiguous()
        if blocks.shape[0] != linear.out_features:
            raise ValueError(f"GGUF blocks for {name} have {blocks.shape[0]} rows, expected {linear.out_features}")
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attribute, GGUFBlockLinear(blocks, kind, linear.in_features, linear.bias))
        replaced += 1
    return replaced
