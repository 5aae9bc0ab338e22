"""Linear layers for serving: the tied output head, and CPU paths that keep every row's arithmetic
the same at every batch size.

On CPU, `F.linear` hands every call to BLAS sgemm (oneDNN in bfloat16), whose blocking, and so
whose sums, follow the batch's shape: a row's last bits would depend on what else shares the step.
`SmallBatchLinear` sends every 2-D batch to ember's C++ kernel instead, which streams the weight
once, in place, and sums each row in one fixed order (kernels/small_batch_linear.cpp; bfloat16
weights: kernels/bf16_linear.cpp). At decode sizes it is several times faster than sgemm, which
repacks the whole weight each call; at prefill sizes it is level with it (512 rows of SmolLM2's
shapes on a Zen 4: 0.9-1.0x sgemm, docs/benchmarks.md). It is an `nn.Linear` holding the same
parameters: no copy, a tied head still shares the embedding.

`GGUFBlockLinear` keeps a GGUF file's quantized blocks (Q4_0 to Q8_0, Q2_K to Q6_K, IQ4_NL, IQ4_XS), or the 16-bit
rows of a bfloat16 / float16 checkpoint, instead of float32 weights and expands them tile by tile
inside the same kernel: its outputs are bit-identical to a float32 `SmallBatchLinear` over the
dequantized weights, for a fraction of the memory traffic. Under the fast numerics (`int8`) it
multiplies the blocks' integers by x quantized to int8 instead (kernels/int8_linear.cpp), at every
row count and in either dtype.
"""

from __future__ import annotations

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.lora import LoRALinear

# The most rows the fused decoder layer (kernels/decoder_layer.cpp) takes in one call: decode steps
# and short prompt chunks; longer ones run layer by layer through the same kernels.
SMALL_BATCH_ROWS = 128


def tied_head(embedding: nn.Embedding) -> nn.Linear:
    """An output head sharing the embedding's weight (logits = hidden @ embedding.T)."""
    head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
    head.weight = embedding.weight
    return head


class SmallBatchLinear(nn.Linear):
    """`nn.Linear` (CPU) that runs float32 and bfloat16 batches of any size on ember's kernels."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> SmallBatchLinear:
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.weight.dtype == torch.bfloat16:
            weight_rows = self.weight.view(torch.uint8)
            return cpu_ops.ops().bf16_linear(x.contiguous(), weight_rows, self.bias, BF16_ROWS_FORMAT, self.in_features)
        if x.dim() == 2:
            return cpu_ops.ops().small_batch_linear(x.contiguous(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


# The format codes of cpu_ops.ops().gguf_block_linear / gguf_dequantize.
GGUF_BLOCK_FORMATS = {
    gguf.GGMLQuantizationType.Q4_1: 0,
    gguf.GGMLQuantizationType.Q8_0: 1,
    gguf.GGMLQuantizationType.Q4_K: 2,
    gguf.GGMLQuantizationType.Q6_K: 3,
    gguf.GGMLQuantizationType.F16: 4,
    gguf.GGMLQuantizationType.BF16: 5,
    gguf.GGMLQuantizationType.Q4_0: 6,
    gguf.GGMLQuantizationType.Q5_0: 7,
    gguf.GGMLQuantizationType.Q5_1: 8,
    gguf.GGMLQuantizationType.Q5_K: 9,
    gguf.GGMLQuantizationType.Q2_K: 10,
    gguf.GGMLQuantizationType.Q3_K: 11,
    gguf.GGMLQuantizationType.IQ4_NL: 12,
    gguf.GGMLQuantizationType.IQ4_XS: 13,
}
# Added to a block format's code where the linear runs the int8 kernel (ops.h's kInt8Arithmetic).
INT8_ARITHMETIC = 256


def kernel_format_code(format_code: int, int8: bool) -> int:
    """The code ember::linear (the fused decoder layer, the experts kernel) takes for blocks of
    format_code, under the fast numerics (int8) or not."""
    return format_code + INT8_ARITHMETIC if int8 else format_code
# The 16-bit row types, by the torch dtype that holds their values; the kernel expands 32 at a time.
SIXTEEN_BIT_KINDS = {torch.bfloat16: gguf.GGMLQuantizationType.BF16, torch.float16: gguf.GGMLQuantizationType.F16}
SIXTEEN_BIT_ROW_MULTIPLE = 32
# A bfloat16 weight's rows, viewed as bytes, are GGUF BF16 rows: bf16_linear's format for them.
BF16_ROWS_FORMAT = GGUF_BLOCK_FORMATS[gguf.GGMLQuantizationType.BF16]


class GGUFBlockLinear(nn.Module):
    """y = x W^T + b with W kept as GGUF blocks: uint8 [out_features, bytes per row], ggml's layout."""

    def __init__(self, blocks: torch.Tensor, kind: gguf.GGMLQuantizationType, in_features: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.bias = bias
        self.kind = kind
        self.format = GGUF_BLOCK_FORMATS[kind]
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.int8 = False  # the fast numerics: int8_weights.use_int8_arithmetic sets it

    @property
    def kernel_format(self) -> int:
        return kernel_format_code(self.format, self.int8)

    def extra_repr(self) -> str:
        arithmetic = ", int8 arithmetic" if self.int8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind.name} blocks{arithmetic}"

    def dequantized_weight(self) -> torch.Tensor:
        return cpu_ops.ops().gguf_dequantize(self.blocks, self.format, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] in float32, or in bfloat16 (a bfloat16 model's: the weight's values
        rounded to bfloat16); every row count on the kernel, as SmallBatchLinear."""
        if self.int8:
            return cpu_ops.ops().int8_linear(x.contiguous(), self.blocks, self.bias, self.format, self.in_features)
        if x.dim() == 2 and x.dtype == torch.bfloat16:
            return cpu_ops.ops().bf16_linear(x.contiguous(), self.blocks, self.bias, self.format, self.in_features)
        return cpu_ops.ops().gguf_block_linear(x.contiguous(), self.blocks, self.bias, self.format, self.in_features)


class StackedBlockLinear(nn.Module):
    """A fused linear (QKV, gate/up) whose parts are stored in different block formats, as a Q4_K_M
    file's Q4_K q/k and Q6_K v: each part's rows run from its own blocks, one after the other."""

    def __init__(self, parts: list[GGUFBlockLinear], bias: nn.Parameter | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias
        self.in_features, self.out_features = parts[0].in_features, sum(part.out_features for part in parts)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([part.dequantized_weight() for part in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each part runs as a GGUFBlockLinear of its own format does, at every row count and dtype:
        one path for single- and mixed-format linears."""
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y.add_(self.bias)


# cpu_ops.ops().llama_decode_layer_'s format code for an [out, in] weight in the activations' dtype.
PLAIN_WEIGHT_FORMAT = -1


def kernel_operands(linear: nn.Module) -> tuple[list[torch.Tensor], torch.Tensor | None, list[int]] | None:
    """(weights or blocks, bias, format codes) of a linear, a weight and a code per part (several for
    a StackedBlockLinear), as cpu_ops.ops().decoder_layer_ takes it; None for a bfloat16 weight of
    rows bf16_linear does not take. A LoRALinear gives its base's (the kernel runs steps with no adapter)."""
    if isinstance(linear, LoRALinear):
        return kernel_operands(linear.base)
    if isinstance(linear, StackedBlockLinear):
        return [part.blocks for part in linear.parts], linear.bias, [part.kernel_format for part in linear.parts]
    if isinstance(linear, GGUFBlockLinear):
        return [linear.blocks], linear.bias, [linear.kernel_format]
    if linear.weight.dtype == torch.bfloat16 and linear.in_features % SIXTEEN_BIT_ROW_MULTIPLE:
        return None  # bf16_linear takes rows of whole 32-value steps
    return [linear.weight], linear.bias, [PLAIN_WEIGHT_FORMAT]


def runs_on_cpu_kernels(model: nn.Module, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether a model runs in one of `dtypes` on the CPU with ember's C++ ops available."""
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype in dtypes and cpu_ops.is_available()


def children_of_type(model: nn.Module, module_type: type[nn.Module]) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, child) of every submodule whose type is exactly module_type."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is module_type
    ]


def use_small_batch_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of a float32 or bfloat16 CPU model for a `SmallBatchLinear` when the
    C++ ops are available (bfloat16: rows of a multiple of SIXTEEN_BIT_ROW_MULTIPLE values, which
    bf16_linear takes); returns how many were swapped."""
    if not runs_on_cpu_kernels(model, (torch.float32, torch.bfloat16)):
        return 0
    targets = [
        target
        for target in children_of_type(model, nn.Linear)
        if target[2].weight.dtype == torch.float32 or target[2].in_features % SIXTEEN_BIT_ROW_MULTIPLE == 0
    ]
    for parent, name, child in targets:
        setattr(parent, name, SmallBatchLinear.sharing(child))
    return len(targets)
