"""The fast numerics on a loaded model (ember_core/numerics.py): every linear over a GGUF file's
quantized blocks, and a mixture of experts' blocks, runs the int8 kernel, while the file's F32 and
16-bit tensors stay float, as llama.cpp computes them. A model with no quantized weights (a float
checkpoint opting in) has its float and 16-bit linears quantized to Q8_0 blocks first, as
llama-quantize would write them. Routers stay float: they pick experts, and files keep them F32
for that reason."""

from __future__ import annotations

import gguf
import torch
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.huge_pages import blocks_on_huge_pages
from ember_core.layers.linear import (
    GGUF_BLOCK_FORMATS,
    PLAIN_WEIGHT_FORMAT,
    SIXTEEN_BIT_KINDS,
    GGUFBlockLinear,
    SmallBatchLinear,
)
from ember_core.layers.moe import Experts, SparseMoE

Q8_0 = gguf.GGMLQuantizationType.Q8_0
_Q8_0_VALUES = gguf.GGML_QUANT_SIZES[Q8_0][0]


def _quantized_weights(module: nn.Module) -> bool:
    if isinstance(module, Experts):
        return module.gate_up_format not in (PLAIN_WEIGHT_FORMAT, *(GGUF_BLOCK_FORMATS[kind] for kind in SIXTEEN_BIT_KINDS.values()))
    return isinstance(module, GGUFBlockLinear) and module.kind not in SIXTEEN_BIT_KINDS.values()


def _float_weight(module: nn.Module) -> torch.Tensor | None:
    """The float values of a linear that is not on quantized blocks (None: it is, or its rows are not whole Q8_0 blocks)."""
    if module.in_features % _Q8_0_VALUES:
        return None
    if isinstance(module, GGUFBlockLinear):
        return None if _quantized_weights(module) else module.dequantized_weight()
    return module.weight.detach() if isinstance(module, nn.Linear) else None


def _routers(model: nn.Module) -> set[int]:
    return {id(router) for moe in model.modules() if isinstance(moe, SparseMoE) for router in (moe.gate, moe.shared_expert_gate)}


def use_int8_arithmetic(model: nn.Module) -> int:
    """Switch the model's quantized linears and experts to the int8 kernel, quantizing its float
    linears and experts first where it holds no quantized weights; returns how many run it."""
    if not any(_quantized_weights(module) for module in model.modules()):
        _quantize_float_weights(model)
        blocks_on_huge_pages(model)
    switched = 0
    for module in model.modules():
        if _quantized_weights(module):
            module.int8 = True
            switched += 1
    return switched


def _quantize_float_weights(model: nn.Module) -> None:
    routers = _routers(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (nn.Linear, SmallBatchLinear, GGUFBlockLinear)) and id(child) not in routers:
                weight = _float_weight(child)
                if weight is not None:
                    blocks = cpu_ops.ops().quantize_q8_0(weight.contiguous())
                    setattr(parent, name, GGUFBlockLinear(blocks, Q8_0, child.in_features, child.bias))
            elif isinstance(child, Experts) and child.gate_up_format == PLAIN_WEIGHT_FORMAT and not (
                child.hidden_size % _Q8_0_VALUES or child.expert_size % _Q8_0_VALUES
            ):
                q8_0 = GGUF_BLOCK_FORMATS[Q8_0]
                child.keep_blocks(_quantized_stack(child.gate_up_proj), q8_0, _quantized_stack(child.down_proj), q8_0)


def _quantized_stack(weights: torch.Tensor) -> torch.Tensor:
    """[experts, rows, columns] float weights as [experts, rows, bytes] Q8_0 blocks."""
    experts, rows, columns = weights.shape
    return cpu_ops.ops().quantize_q8_0(weights.detach().reshape(experts * rows, columns)).view(experts, rows, -1)
