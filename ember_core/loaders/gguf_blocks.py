"""Keep a GGUF file's quantized weights in their blocks: swap the loaded float32 or bfloat16 Linears for
`GGUFBlockLinear`s over the file's Q4_0 to Q8_0, Q2_K to Q6_K, IQ4_NL and IQ4_XS rows (fused QKV and gate/up stacked as
at load; `StackedBlockLinear` where their parts mix formats), and a sparse layer's experts for their stacked blocks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from torch import nn

from ember_core.layers.block_embedding import GGUFBlockEmbedding
from ember_core.layers.linear import (
    GGUF_BLOCK_FORMATS,
    SIXTEEN_BIT_KINDS,
    SIXTEEN_BIT_ROW_MULTIPLE,
    GGUFBlockLinear,
    StackedBlockLinear,
)
from ember_core.layers.moe import Experts
from ember_core.loaders.gguf_tensors import EXPERT_TENSORS, NOT_WEIGHTS, hf_name, in_hf_row_order
from ember_core.models.decoder import Decoder


def _shard_names(model: Decoder, module_name: str) -> list[str]:
    """The HF module names (no `model.` prefix) whose weights fill this Linear's rows, in order."""
    family = model.config.family
    for fused, shards in model.fused_shards().items():
        if module_name.endswith(f".{fused}"):
            prefix = module_name.removesuffix(fused)
            return [family.checkpoint_name(f"{prefix}{shard}.weight").removesuffix(".weight") for shard, _ in shards]
    if module_name == "lm_head" and model.config.tie_word_embeddings:
        return ["embed_tokens"]
    return [family.checkpoint_name(model.hf_names().get(f"{module_name}.weight", f"{module_name}.weight")).removesuffix(".weight")]


def _as_bytes(tensor: ReaderTensor) -> torch.Tensor:
    """A tensor's rows as uint8 blocks (16-bit rows included), in the file's shape."""
    data = torch.from_numpy(np.array(tensor.data))
    return data if data.dtype == torch.uint8 else data.view(torch.uint8)


class MisalignedColumns(ValueError):
    """A rank's columns of a tensor start or end inside a block."""


@dataclass(frozen=True)
class BlockRows:
    """A matrix's rows as uint8 blocks, indexed by its values' rows and columns, as a tensor-parallel
    rank's DecoderShards.take indexes it: a column range must start and end on block boundaries."""

    blocks: torch.Tensor  # [rows, bytes per row]
    kind: gguf.GGMLQuantizationType

    def get_shape(self) -> tuple[int, int]:
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.kind]
        return self.blocks.shape[0], self.blocks.shape[1] // type_size * block_size

    def __getitem__(self, index: slice | tuple[slice, slice]) -> torch.Tensor:
        if not isinstance(index, tuple):
            return self.blocks[index]
        rows, columns = index
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.kind]
        if columns.start % block_size or columns.stop % block_size:
            raise MisalignedColumns(f"columns {columns.start}:{columns.stop} cut {self.kind.name}'s {block_size}-wide blocks")
        return self.blocks[rows, columns.start // block_size * type_size : columns.stop // block_size * type_size]


def _taken(model: Decoder, name: str, blocks: torch.Tensor, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    """The blocks of checkpoint tensor `name` (HF's) this model holds: all of them, or its
    tensor-parallel rank's part."""
    return blocks if model.shards is None else model.shards.take(name, BlockRows(blocks, kind))


def _expert_blocks(model: Decoder, tensor: ReaderTensor) -> torch.Tensor:
    """A sparse layer's stacked experts' blocks [experts, rows, bytes], this model's part of them."""
    name = hf_name(tensor.name, model.config.family)
    return torch.stack([
        _taken(model, name.replace(".experts.", f".experts.{expert}."), blocks, tensor.tensor_type)
        for expert, blocks in enumerate(_as_bytes(tensor))
    ])


def _keep_expert_blocks(model: Decoder, experts: Experts, layer: int, by_name: dict[str, ReaderTensor]) -> bool:
    """Give a sparse layer's experts the file's blocks when gate and up share a format the kernels
    read (and down is in one), else leave them dense; returns whether they took the blocks."""
    gate, up, down = (by_name[f"blk.{layer}.{name}.weight"] for name in EXPERT_TENSORS)
    if gate.tensor_type != up.tensor_type or any(t.tensor_type not in GGUF_BLOCK_FORMATS for t in (gate, down)):
        return False
    sixteen_bit = {t.tensor_type for t in (gate, down)} & set(SIXTEEN_BIT_KINDS.values())
    if sixteen_bit and (experts.hidden_size % SIXTEEN_BIT_ROW_MULTIPLE or experts.expert_size % SIXTEEN_BIT_ROW_MULTIPLE):
        return False
    try:
        gate_up = torch.cat([_expert_blocks(model, gate), _expert_blocks(model, up)], dim=1).contiguous()
        down_blocks = _expert_blocks(model, down)
    except MisalignedColumns:  # this rank's down columns cut blocks: its experts stay dense
        return False
    experts.keep_blocks(gate_up, GGUF_BLOCK_FORMATS[gate.tensor_type], down_blocks, GGUF_BLOCK_FORMATS[down.tensor_type])
    return True


def _blocks_in_hf_order(model: Decoder, shards: list[tuple[str, ReaderTensor]]) -> torch.Tensor:
    """The shards' rows as uint8 blocks (16-bit rows included), stacked in the fused HF order."""
    rows = []
    for shard, tensor in shards:
        blocks = in_hf_row_order(f"{shard}.weight", _as_bytes(tensor), model.config)
        rows.append(_taken(model, f"model.{shard}.weight", blocks, tensor.tensor_type))
    return torch.cat(rows).contiguous()


def _block_linear(model: Decoder, name: str, shards: list[tuple[str, ReaderTensor]], linear: nn.Linear) -> nn.Module | None:
    """A GGUFBlockLinear over the shards' blocks, a StackedBlockLinear when they mix formats, or None
    when one format is not the kernel's or all are 16-bit (those keep_16_bit_weights keeps)."""
    kinds = [tensor.tensor_type for _, tensor in shards]
    sixteen_bit = [kind in SIXTEEN_BIT_KINDS.values() for kind in kinds]
    if any(kind not in GGUF_BLOCK_FORMATS for kind in kinds) or all(sixteen_bit):
        return None
    if any(sixteen_bit) and linear.in_features % SIXTEEN_BIT_ROW_MULTIPLE:
        return None
    # Runs of consecutive shards in one format, e.g. [q, k] in Q4_K and [v] in Q6_K.
    try:
        parts = [
            GGUFBlockLinear(_blocks_in_hf_order(model, list(run)), kind, linear.in_features, None)
            for kind, run in itertools.groupby(shards, key=lambda shard: shard[1].tensor_type)
        ]
    except MisalignedColumns:  # this rank's columns cut blocks: it keeps its part's dequantized rows
        return None
    rows = sum(part.out_features for part in parts)
    if rows != linear.out_features:
        raise ValueError(f"{name}: GGUF blocks have {rows} rows, expected {linear.out_features}")
    if len(parts) == 1:
        parts[0].bias = linear.bias
        return parts[0]
    return StackedBlockLinear(parts, linear.bias)


def keep_gguf_blocks(model: Decoder, tensors: list[ReaderTensor], only_layer: int | None = None) -> int:
    """Replace each Linear whose GGUF tensors are all in block formats the kernel reads, and the
    token embedding when it is in one (sharing a tied head's blocks); returns how many.

    The model must already hold the dequantized weights: a module with a tensor in another format
    (such as IQ3_S or F32) keeps them; 16-bit ones are keep_16_bit_weights' job. only_layer: just
    that decoder layer's Linears and experts, on a model built without weights (the dtype probe's).
    """
    by_module = {
        hf_name(t.name, model.config.family).removeprefix("model.").removesuffix(".weight"): t
        for t in tensors
        if t.name not in NOT_WEIGHTS and t.name.endswith(".weight")
    }
    linears = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    if only_layer is not None:
        linears = [(name, linear) for name, linear in linears if name.startswith(f"layers.{only_layer}.")]
    replaced = 0
    for name, linear in linears:
        block_linear = _block_linear(model, name, [(shard, by_module[shard]) for shard in _shard_names(model, name)], linear)
        if block_linear is None:
            continue
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attribute, block_linear)
        replaced += 1
    by_name = {t.name: t for t in tensors}
    for name, module in model.named_modules():
        layer = int(name.split(".")[1]) if isinstance(module, Experts) else None
        if layer is not None and only_layer in (None, layer):
            replaced += _keep_expert_blocks(model, module, layer, by_name)
    if only_layer is not None:
        return replaced
    embedding = by_module["embed_tokens"]
    if embedding.tensor_type in GGUF_BLOCK_FORMATS and embedding.tensor_type not in SIXTEEN_BIT_KINDS.values():
        head = model.lm_head
        tied = model.config.tie_word_embeddings and isinstance(head, GGUFBlockLinear)
        blocks = head.blocks if tied else _blocks_in_hf_order(model, [("embed_tokens", embedding)])
        dtype = model.embed_tokens.weight.dtype
        model.embed_tokens = GGUFBlockEmbedding(blocks, embedding.tensor_type, model.config.hidden_size, dtype)
        replaced += 1
    return replaced
