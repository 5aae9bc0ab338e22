"""The C++ linear kernels (float32 weights, GGUF blocks) against F.linear and gguf-py, and where the runner uses them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.block_embedding import GGUFBlockEmbedding
from ember_core.layers.linear import (
    GGUF_BLOCK_FORMATS,
    SIXTEEN_BIT_KINDS,
    SIXTEEN_BIT_ROW_MULTIPLE,
    SMALL_BATCH_ROWS,
    GGUFBlockLinear,
    SmallBatchLinear,
    StackedBlockLinear,
    tied_head,
    use_small_batch_linears,
)
from ember_core.layers.sixteen_bit_weights import keep_16_bit_weights


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 33, SMALL_BATCH_ROWS, 300])
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 200), (64, 384), (13, 7), (576, 49)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_computes_what_f_linear_computes(rows: int, in_features: int, out_features: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    actual = cpu_ops.ops().small_batch_linear(x, weight, b)
    # float32 sums of up to 576 unit-scale products, added in another order than BLAS does
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=5e-5)


@pytest.mark.usefixtures("kernel")
def test_kernel_rejects_what_it_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32 CPU tensor"):
        cpu_ops.ops().small_batch_linear(torch.ones(2, 8, dtype=torch.float64), torch.ones(4, 8, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 CPU tensor"):
        cpu_ops.ops().small_batch_linear(torch.ones(2, 8, dtype=torch.float64), torch.ones(4, 8), None)
    with pytest.raises(RuntimeError, match="x must be \\[m, 9\\]"):
        cpu_ops.ops().small_batch_linear(torch.ones(2, 8), torch.ones(4, 9), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_ops.ops().small_batch_linear(torch.ones(2, 8), torch.ones(4, 8), torch.ones(5))


@pytest.mark.usefixtures("kernel")
def test_layer_shares_the_weights_and_gives_a_row_the_same_bits_in_any_batch() -> None:
    embedding = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embedding, "proj": nn.Linear(16, 24), "head": tied_head(embedding)})
    weights = {name: p for name, p in model.named_parameters()}
    assert use_small_batch_linears(model) == 2
    assert isinstance(model["proj"], SmallBatchLinear) and isinstance(model["head"], SmallBatchLinear)
    assert dict(model.named_parameters()) == weights  # the same Parameter objects, tie included
    assert model["head"].weight is embedding.weight
    with torch.inference_mode():
        alone = model["proj"](torch.ones(1, 16))
        for rows in (3, SMALL_BATCH_ROWS + 7, 600):  # every row count on the kernel
            x = torch.randn(rows, 16)
            x[rows // 2] = 1.0
            expected = F.linear(x, model["proj"].weight, model["proj"].bias)
            torch.testing.assert_close(model["proj"](x), expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(model["proj"](x)[rows // 2], alone[0])
            non_contiguous = torch.randn(16, rows).t()
            torch.testing.assert_close(model["head"](non_contiguous), non_contiguous @ embedding.weight.t())


def test_only_float32_cpu_models_are_swapped() -> None:
    model = nn.Sequential(nn.Linear(8, 8).double())
    assert use_small_batch_linears(model) == 0
    assert type(model[0]) is nn.Linear


@pytest.mark.usefixtures("kernel")
def test_engine_serves_float32_cpu_models_through_the_kernel(gpt2_llm) -> None:
    """So the exactness tests against transformers run through it."""
    model = gpt2_llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, SmallBatchLinear) for m in linears)


# --- GGUF blocks --------------------------------------------------------------------------------

Q = gguf.GGMLQuantizationType
BLOCK_KINDS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.F16, Q.BF16]
# The float16 fields of the block types gguf-py cannot quantize to: Q4_K's and Q5_K's d and dmin
# lead a block; Q2_K's d and dmin, Q3_K's and Q6_K's d end it; IQ4_NL's and IQ4_XS's d lead it.
RANDOM_BLOCK_HALF_OFFSETS = {
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)
}


def random_blocks(kind: gguf.GGMLQuantizationType, out_features: int, in_features: int, seed: int, scale: float) -> np.ndarray:
    """Rows of random blocks of a type gguf-py cannot quantize to, whose float16 factors are
    uniform in [0, scale), so that values stay in a weight's range."""
    values_per_block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // values_per_block, block_bytes), dtype=np.uint8)
    for offset in RANDOM_BLOCK_HALF_OFFSETS[kind]:
        factors = (rng.random(blocks.shape[:2]) * scale).astype(np.float16)
        blocks[:, :, offset : offset + 2] = factors[..., None].view(np.uint8)
    return blocks.reshape(out_features, -1)


def _blocks(kind: gguf.GGMLQuantizationType, out_features: int, blocks_per_row: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of a random weight (gguf-py's quantization, or random blocks), and gguf-py's float32 values of them."""
    values_per_block = SIXTEEN_BIT_ROW_MULTIPLE if kind in SIXTEEN_BIT_KINDS.values() else gguf.GGML_QUANT_SIZES[kind][0]
    in_features = blocks_per_row * values_per_block
    if kind in RANDOM_BLOCK_HALF_OFFSETS:
        blocks = random_blocks(kind, out_features, in_features, seed, scale=1e-3)
    else:
        weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)).numpy()
        blocks = gguf.quants.quantize(weight, kind)
    values = np.asarray(gguf.quants.dequantize(blocks, kind), dtype=np.float32).reshape(out_features, in_features)
    return torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8)), torch.from_numpy(values)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize(("out_features", "blocks_per_row"), [(37, 3), (8, 1), (3, 18)])
def test_blocks_expand_to_exactly_gguf_py_values(kind: gguf.GGMLQuantizationType, out_features: int, blocks_per_row: int) -> None:
    blocks, values = _blocks(kind, out_features, blocks_per_row, seed=out_features)
    assert values.abs().max() > 0.01  # random blocks' factors: not all rounded to zero
    actual = cpu_ops.ops().gguf_dequantize(blocks, GGUF_BLOCK_FORMATS[kind], values.shape[1])
    assert torch.equal(actual, values)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 16, SMALL_BATCH_ROWS])
@pytest.mark.parametrize("bias", [True, False])
def test_block_kernel_is_bit_identical_to_the_float32_kernel(kind: gguf.GGMLQuantizationType, rows: int, bias: bool) -> None:
    blocks, values = _blocks(kind, 45, 5, seed=rows)  # 45 rows: whole tiles of 4 and 8 plus a remainder
    in_features = values.shape[1]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7))
    b = torch.randn(45) if bias else None
    actual = cpu_ops.ops().gguf_block_linear(x, blocks, b, GGUF_BLOCK_FORMATS[kind], in_features)
    assert torch.equal(actual, cpu_ops.ops().small_batch_linear(x, values, b))


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0, Q.Q6_K], ids=lambda kind: kind.name)
def test_each_output_row_has_the_same_bits_whatever_the_other_rows(kind: gguf.GGMLQuantizationType) -> None:
    """A row of x gets the same bits alone (the one-row path), with 1-2 others (8-float tiles) and
    in a batch (paired rows on AVX-512, from 4 rows), from blocks and from float32 weights: what makes
    a request's logprobs independent of the batch it runs in."""
    blocks, values = _blocks(kind, 45, 9, seed=11)
    in_features = values.shape[1]
    x = torch.randn(17, in_features, generator=torch.Generator().manual_seed(8))
    b = torch.randn(45)
    alone = torch.cat([cpu_ops.ops().small_batch_linear(x[i : i + 1], values, b) for i in range(17)])
    for rows in range(1, 18):
        assert torch.equal(cpu_ops.ops().small_batch_linear(x[:rows], values, b), alone[:rows]), rows
        assert torch.equal(cpu_ops.ops().gguf_block_linear(x[:rows], blocks, b, GGUF_BLOCK_FORMATS[kind], in_features), alone[:rows]), rows
    odd = torch.randn(6, 13)  # 13 values: one vector and a tail of 5
    weight = torch.randn(7, 13)
    alone = torch.cat([cpu_ops.ops().small_batch_linear(odd[i : i + 1], weight, None) for i in range(6)])
    assert torch.equal(cpu_ops.ops().small_batch_linear(odd, weight, None), alone)


@pytest.mark.usefixtures("kernel")
def test_block_layer_matches_a_float32_layer_over_the_same_values() -> None:
    blocks, values = _blocks(Q.Q4_1, 24, 2, seed=3)
    bias = nn.Parameter(torch.randn(24))
    layer = GGUFBlockLinear(blocks, Q.Q4_1, 64, bias)
    reference = SmallBatchLinear(64, 24)
    with torch.no_grad():
        reference.weight.copy_(values)
        reference.bias.copy_(bias)
    assert (layer.in_features, layer.out_features) == (64, 24) and "Q4_1 blocks" in repr(layer)
    with torch.inference_mode():
        for rows in (1, 3, SMALL_BATCH_ROWS + 9):
            x = torch.randn(rows, 64)
            assert torch.equal(layer(x), reference(x))


@pytest.mark.usefixtures("kernel")
def test_stacked_parts_in_different_formats_match_one_float32_layer() -> None:
    """A fused QKV whose q/k are Q4_K and v Q6_K (a Q4_K_M file), with a bias."""
    kinds = [Q.Q4_K, Q.Q6_K, Q.F16]
    parts = [_blocks(kind, rows, 512 // per_block, seed=rows) for kind, rows, per_block in zip(kinds, (40, 24, 8), (256, 256, 32))]
    bias = nn.Parameter(torch.randn(72))
    layer = StackedBlockLinear([GGUFBlockLinear(blocks, kind, 512, None) for (blocks, _), kind in zip(parts, kinds)], bias)
    reference = SmallBatchLinear(512, 72)
    with torch.no_grad():
        reference.weight.copy_(torch.cat([values for _, values in parts]))
        reference.bias.copy_(bias)
    assert (layer.in_features, layer.out_features) == (512, 72)
    with torch.inference_mode():
        for rows in (1, 16, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 9):
            x = torch.randn(rows, 512)
            assert torch.equal(layer(x), reference(x)), rows


# Every format ember reads, paired in a fused linear with one of another super-block size, as a
# llama-quantize mix pairs them (Q4_K q/k with Q6_K or Q8_0 v; Q5_0 with Q8_0).
STACKED_PARTNER = {kind: Q.Q8_0 if gguf.GGML_QUANT_SIZES[kind][0] == 256 else Q.Q6_K for kind in BLOCK_KINDS}


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_format_runs_alone_and_stacked_at_every_row_count_in_every_dtype(kind: gguf.GGMLQuantizationType, dtype: torch.dtype) -> None:
    """No format, dtype and row count falls through to a path that fails (a bfloat16 step of more than
    SMALL_BATCH_ROWS rows over a mixed-format fused linear once did), and each gives the dequantized
    weights' product."""
    in_features = 512
    parts = [_blocks(k, rows, in_features // _values_per_block(k), seed=rows) for k, rows in ((kind, 40), (STACKED_PARTNER[kind], 24))]
    bias = nn.Parameter(torch.randn(64).to(dtype))
    single = GGUFBlockLinear(parts[0][0], kind, in_features, nn.Parameter(bias[:40].detach().clone()))
    stacked = StackedBlockLinear([GGUFBlockLinear(blocks, k, in_features, None) for (blocks, _), k in zip(parts, (kind, STACKED_PARTNER[kind]))], bias)
    weight = torch.cat([values for _, values in parts])
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.3}
    with torch.inference_mode():
        for rows in (1, 5, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 300):
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
            expected = F.linear(x.double(), weight.double(), bias.double())
            for layer, columns in ((single, 40), (stacked, 64)):
                y = layer(x)
                assert y.dtype == dtype and y.shape == (rows, columns)
                torch.testing.assert_close(y.double(), expected[:, :columns], **tolerance)


def _values_per_block(kind: gguf.GGMLQuantizationType) -> int:
    return SIXTEEN_BIT_ROW_MULTIPLE if kind in SIXTEEN_BIT_KINDS.values() else gguf.GGML_QUANT_SIZES[kind][0]


@pytest.mark.usefixtures("kernel")
def test_block_kernel_rejects_blocks_that_do_not_fit() -> None:
    blocks, _ = _blocks(Q.Q4_1, 4, 2, seed=0)
    with pytest.raises(RuntimeError, match="rows of 96 weights take 60 bytes in this format, blocks has 40"):
        cpu_ops.ops().gguf_block_linear(torch.ones(2, 96), blocks, None, 0, 96)
    with pytest.raises(RuntimeError, match="unknown GGUF block format 17"):
        cpu_ops.ops().gguf_dequantize(blocks, 17, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.ops().gguf_dequantize(blocks, 0, 40)
    with pytest.raises(RuntimeError, match="multiple of 256 in this format"):
        cpu_ops.ops().gguf_dequantize(blocks, GGUF_BLOCK_FORMATS[Q.Q4_K], 64)
    with pytest.raises(RuntimeError, match="x must be \\[m, 64\\]"):
        cpu_ops.ops().gguf_block_linear(torch.ones(2, 32), blocks, None, 0, 64)


@pytest.mark.usefixtures("kernel")
def test_16_bit_weights_run_from_their_rows_with_the_same_bits() -> None:
    """A bf16 / f16 checkpoint loaded in float32 holds only 16-bit values: those Linears keep 16-bit rows."""
    generator = torch.Generator().manual_seed(0)
    embedding = nn.Embedding(50, 64)
    layers = {
        "bf16": nn.Linear(64, 96),  # bfloat16 values
        "f16": nn.Linear(64, 32, bias=False),  # float16 values with more mantissa bits than bfloat16 has
        "float32": nn.Linear(64, 32),  # values neither type holds
        "odd": nn.Linear(40, 32),  # bfloat16 values, but rows the kernel does not take in 32s
    }
    model = nn.ModuleDict({"embed": embedding, "head": tied_head(embedding), **layers})
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(50, 64, generator=generator).bfloat16())
        for name, layer in layers.items():
            weight = torch.randn(layer.weight.shape, generator=generator)
            layer.weight.copy_(weight.half() if name == "f16" else weight if name == "float32" else weight.bfloat16())
    assert not torch.equal(layers["f16"].weight.bfloat16().float(), layers["f16"].weight)
    inputs = {rows: torch.randn(rows, 64, generator=generator) for rows in (1, 16, SMALL_BATCH_ROWS + 5)}
    # What the runner would run otherwise: the same weights in float32 through SmallBatchLinear.
    float32_layers = {name: SmallBatchLinear.sharing(model[name]) for name in ("head", "bf16", "f16")}
    with torch.inference_mode():
        before = {name: {rows: layer(x) for rows, x in inputs.items()} for name, layer in float32_layers.items()}

    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    expected_embedding = F.embedding(ids, embedding.weight)
    assert keep_16_bit_weights(model) == 4
    assert model["head"].kind == SIXTEEN_BIT_KINDS[torch.bfloat16] and model["bf16"].kind == SIXTEEN_BIT_KINDS[torch.bfloat16]
    assert model["f16"].kind == SIXTEEN_BIT_KINDS[torch.float16] and model["f16"].blocks.shape == (32, 128)
    assert type(model["float32"]) is nn.Linear and type(model["odd"]) is nn.Linear and 40 % SIXTEEN_BIT_ROW_MULTIPLE
    # The tied embedding and head share one copy of the bf16 rows; lookups give the float32 values.
    assert isinstance(model["embed"], GGUFBlockEmbedding) and model["embed"].blocks is model["head"].blocks
    assert torch.equal(model["embed"](ids), expected_embedding)
    with torch.inference_mode():
        for name, outputs in before.items():
            for rows, x in inputs.items():
                assert torch.equal(model[name](x), outputs[rows]), (name, rows)


def test_16_bit_weights_stay_float32_tensors_off_the_float32_cpu_path() -> None:
    model = nn.Sequential(nn.Linear(32, 8).bfloat16())
    assert keep_16_bit_weights(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q6_K, Q.BF16], ids=lambda kind: kind.name)
def test_block_embedding_looks_up_the_dequantized_rows(kind: gguf.GGMLQuantizationType) -> None:
    blocks, values = _blocks(kind, 50, 512 // (256 if kind == Q.Q6_K else 32), seed=11)
    embedding = GGUFBlockEmbedding(blocks, kind, 512)
    assert (embedding.num_embeddings, embedding.embedding_dim) == (50, 512) and f"{kind.name} blocks" in repr(embedding)
    assert torch.equal(embedding.dequantized_weight(), values)
    for ids in (torch.tensor([0, 49, 3, 3]), torch.tensor([[5, 1], [2, 40]]), torch.tensor([], dtype=torch.long)):
        assert torch.equal(embedding(ids), F.embedding(ids, values))
    with pytest.raises(IndexError):
        embedding(torch.tensor([50]))
