"""The fast numerics' linear (kernels/int8_linear.cpp): activations quantized to int8 per block of 32
values, the GGUF blocks' integers, integer dot products. Against a reference written out in float64
from the same quantized activations and gguf-py's dequantized weights it differs only by float32
rounding; each output's bits depend on its own rows only, at every row count and on every
instruction set's build."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.linear import (
    GGUF_BLOCK_FORMATS,
    INT8_ARITHMETIC,
    GGUFBlockLinear,
    StackedBlockLinear,
    kernel_operands,
)
from tests.core.layers.test_linear import Q, _blocks

QUANTIZED_KINDS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
# One row, a few rows expanded as they are read, and more rows than a tile's register rows (a
# buffer of expanded blocks), each with remainders; on the amx build, 12 rows or more take AMX tiles
# (16 x rows a group), whose bits the same-bits test below holds to the one-row vector path's.
ROW_COUNTS = [1, 2, 3, 5, 9, 17, 40]
IN_FEATURES = 1024  # four K-quant super-blocks: every sub-block's scale bits are read


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per block of 32 values, scale = max|x| / 127, q = round(x / scale) to
    nearest even (x * (127 / max|x|), in float32), in float64."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    # 127 / largest rounded once, as the kernel divides (torch's 127.0 / t multiplies by t's reciprocal)
    inverse = torch.where(largest > 0, (127.0 / largest.double()).float(), torch.zeros_like(largest))
    q = torch.round(blocks * inverse)
    return (q.double() * (largest / 127.0).double()).reshape(x.shape)


def _weights(kind: gguf.GGMLQuantizationType, out_features: int = 45, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return _blocks(kind, out_features, IN_FEATURES // gguf.GGML_QUANT_SIZES[kind][0], seed=seed)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", QUANTIZED_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_products_are_those_of_the_quantized_activations_and_the_dequantized_weights(kind, rows: int) -> None:
    blocks, values = _weights(kind)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, IN_FEATURES, generator=generator) * torch.rand(IN_FEATURES, generator=generator) * 4
    bias = torch.randn(45)
    y = cpu_ops.ops().int8_linear(x, blocks, bias, GGUF_BLOCK_FORMATS[kind], IN_FEATURES)
    expected = quantized_activations(x) @ values.double().T + bias.double()
    assert y.dtype == torch.float32 and y.shape == (rows, 45)
    # float32 sums of 1,024 products in the kernel's order: within a few ulps of the products' magnitudes
    magnitudes = quantized_activations(x).abs() @ values.double().abs().T + bias.double().abs()
    assert torch.all((y.double() - expected).abs() <= 1e-6 * magnitudes)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", QUANTIZED_KINDS, ids=lambda kind: kind.name)
def test_each_row_has_the_same_bits_alone_and_in_any_batch(kind) -> None:
    blocks, _ = _weights(kind, out_features=37)  # four groups of 8 rows and a partial one
    x = torch.randn(40, IN_FEATURES, generator=torch.Generator().manual_seed(9))
    bias = torch.randn(37)
    ops, form = cpu_ops.ops(), GGUF_BLOCK_FORMATS[kind]
    alone = torch.cat([ops.int8_linear(x[i : i + 1], blocks, bias, form, IN_FEATURES) for i in range(40)])
    for rows in (2, 3, 8, 9, 16, 33, 40):
        for start in (0, 40 - rows):
            assert torch.equal(ops.int8_linear(x[start : start + rows], blocks, bias, form, IN_FEATURES), alone[start : start + rows]), (rows, start)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q6_K, Q.Q8_0], ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [5, 16])  # 16: AMX tiles on the amx build
def test_bfloat16_activations_are_widened_and_the_outputs_rounded_once(kind, rows: int) -> None:
    blocks, _ = _weights(kind)
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(2)).bfloat16()
    bias = torch.randn(45).bfloat16()
    ops, form = cpu_ops.ops(), GGUF_BLOCK_FORMATS[kind]
    y = ops.int8_linear(x, blocks, bias, form, IN_FEATURES)
    in_float32 = ops.int8_linear(x.float(), blocks, bias.float(), form, IN_FEATURES)
    assert y.dtype == torch.bfloat16 and torch.equal(y, in_float32.bfloat16())


@pytest.mark.usefixtures("kernel")
def test_zero_rows_and_zero_blocks_give_exact_results() -> None:
    blocks, values = _weights(Q.Q4_K)
    x = torch.zeros(3, IN_FEATURES)
    x[1, :32] = 1.0  # one block of ones, the others zero: scale 0 blocks contribute nothing
    y = cpu_ops.ops().int8_linear(x, blocks, None, GGUF_BLOCK_FORMATS[Q.Q4_K], IN_FEATURES)
    assert torch.equal(y[0], torch.zeros(45)) and torch.equal(y[2], torch.zeros(45))
    torch.testing.assert_close(y[1].double(), values[:, :32].double().sum(dim=1), rtol=1e-6, atol=1e-6)
    assert cpu_ops.ops().int8_linear(torch.zeros(0, IN_FEATURES), blocks, None, GGUF_BLOCK_FORMATS[Q.Q4_K], IN_FEATURES).shape == (0, 45)


@pytest.mark.usefixtures("kernel")
def test_it_refuses_what_it_cannot_compute() -> None:
    blocks, _ = _weights(Q.Q8_0)
    ops = cpu_ops.ops()
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16 CPU tensor"):
        ops.int8_linear(torch.ones(2, IN_FEATURES, dtype=torch.float64), blocks, None, GGUF_BLOCK_FORMATS[Q.Q8_0], IN_FEATURES)
    with pytest.raises(RuntimeError, match="blocks must be a contiguous uint8 CPU tensor"):
        ops.int8_linear(torch.ones(2, 512), blocks, None, GGUF_BLOCK_FORMATS[Q.Q8_0], 512)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.int8_linear(torch.ones(2, IN_FEATURES), blocks, torch.ones(45).bfloat16(), GGUF_BLOCK_FORMATS[Q.Q8_0], IN_FEATURES)
    with pytest.raises(RuntimeError, match="16-bit rows"):
        ops.int8_linear(torch.ones(2, 32), torch.zeros(3, 64, dtype=torch.uint8), None, GGUF_BLOCK_FORMATS[Q.F16], 32)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_float_weights_quantize_to_q8_0_blocks_as_llama_cpp_writes_them(dtype) -> None:
    weight = (torch.randn(7, 96, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    weight[2, 32:64] = 0  # an all-zero block: scale 0
    blocks = cpu_ops.ops().quantize_q8_0(weight)
    assert blocks.dtype == torch.uint8 and blocks.shape == (7, 3 * 34)
    values = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), Q.Q8_0)).reshape(7, 96)
    w = weight.float().reshape(7, 3, 32)
    scale = (w.abs().amax(dim=-1, keepdim=True) / 127).half().float()  # ggml stores d as float16
    # round(x / d) in float32, then d rounded to float16 for storage: off by at most d / 2 + 127 d 2^-11
    assert torch.all((values.reshape(7, 3, 32) - w).abs() <= scale * 0.57 + 1e-7)
    assert torch.equal(values[2, 32:64], torch.zeros(32))


@pytest.mark.usefixtures("kernel")
def test_layers_switched_to_int8_run_it_alone_stacked_and_in_the_fused_layer_codes() -> None:
    (q4k, q4k_values), (q6k, q6k_values) = _weights(Q.Q4_K, 40), _weights(Q.Q6_K, 24)
    parts = [GGUFBlockLinear(q4k, Q.Q4_K, IN_FEATURES, None), GGUFBlockLinear(q6k, Q.Q6_K, IN_FEATURES, None)]
    stacked = StackedBlockLinear(parts, nn.Parameter(torch.randn(64)))
    for part in parts:
        part.int8 = True
    assert "int8 arithmetic" in repr(parts[0]) and kernel_operands(parts[0])[2] == [GGUF_BLOCK_FORMATS[Q.Q4_K] + INT8_ARITHMETIC]
    x = torch.randn(150, IN_FEATURES)
    with torch.inference_mode():
        y = stacked(x)
    expected = F.linear(quantized_activations(x), torch.cat([q4k_values, q6k_values]).double(), stacked.bias.double())
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)
