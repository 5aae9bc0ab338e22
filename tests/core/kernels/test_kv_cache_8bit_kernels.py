"""The 8-bit KV cache in ember's C++ ops (int8 and e4m3 codes of rotated heads with a float16 scale per
token and KV head): the write quantizes as layers/kv_quant.py does, bit for bit, and decode attention over the
codes equals attention over their dequantized values, on every instruction set's build."""

from __future__ import annotations

import pytest
import torch

from ember_core.kernels import cpu_ops
from ember_core.layers.kv_quant import dequantize, quantize, rotate
from tests.core.kernels.test_kernels import Case, make_case, reference, run_kernel, windowed_reference, with_changes

QUANTIZED = [torch.int8, torch.float8_e4m3fn]
IDS = ["int8", "e4m3"]
# Codes of an unused slot: huge values, so a read of one shows up (NaN has no 8-bit code).
UNUSED = 1e4


def quantized_case(case: Case, cache_dtype: torch.dtype) -> Case:
    return with_changes(
        case,
        key_cache=quantize(case.key_cache.nan_to_num(UNUSED), cache_dtype),
        value_cache=quantize(case.value_cache.nan_to_num(UNUSED), cache_dtype),
    )


def float32_tolerance(cache_dtype: torch.dtype) -> float:
    """How far a float32 query's attention over codes may be from attention over their values. The
    AVX-512 builds dot int8 keys with the query as int16 codes in integers (a step of 2^-15 of the
    head's largest value: 100x finer than the keys' own 8-bit step)."""
    return 1e-4 if cache_dtype == torch.int8 else 2e-5


def dequantized(case: Case) -> Case:
    """The case with its caches' values widened to float32: what the kernel must compute over."""
    return with_changes(case, key_cache=dequantize(case.key_cache, torch.float32),
                        value_cache=dequantize(case.value_cache, torch.float32))


@pytest.mark.parametrize("cache_dtype", QUANTIZED, ids=IDS)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (1, 5)], ids=["gqa3", "mqa5"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (36, 5)])
def test_attention_over_codes_is_attention_over_their_values(
    kernel: None, cache_dtype: torch.dtype, query_dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int,
    block_size: int,
) -> None:
    context_lens = [1, block_size, block_size + 1, 100, 47, 300, 600]
    case = make_case(context_lens, num_kv_heads, group, head_dim, block_size, torch.float32)
    case = quantized_case(with_changes(case, query=case.query.to(query_dtype)), cache_dtype)
    out = run_kernel(case)
    assert out.dtype == query_dtype and out.shape == case.query.shape
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[query_dtype]
    if query_dtype == torch.float32:
        tolerance = float32_tolerance(cache_dtype)
    torch.testing.assert_close(out.double(), reference(dequantized(case)), atol=tolerance, rtol=0)


@pytest.mark.parametrize("cache_dtype", QUANTIZED, ids=IDS)
@pytest.mark.parametrize(("window", "softcap"), [(0, 2.0), (7, 0.0), (100, 30.0)])
def test_sliding_windows_and_soft_caps_over_codes(kernel: None, cache_dtype: torch.dtype, window: int, softcap: float) -> None:
    context_lens = [1, 7, 17, 100, 301]
    case = quantized_case(make_case(context_lens, num_kv_heads=2, group=3, head_dim=64, block_size=16, dtype=torch.float32), cache_dtype)
    out = cpu_ops.paged_decode_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.context_lens, case.scale, softcap, window
    )
    torch.testing.assert_close(
        out.double(), windowed_reference(dequantized(case), window, softcap), atol=float32_tolerance(cache_dtype), rtol=0
    )
    for b in (0, 4):  # a sequence's bits are its own, alone or batched
        alone = cpu_ops.paged_decode_attention(
            case.query[b : b + 1], case.key_cache, case.value_cache, case.block_tables[b : b + 1],
            case.context_lens[b : b + 1], case.scale, softcap, window,
        )
        assert torch.equal(alone, out[b : b + 1])


def test_every_float_query_may_read_an_8bit_cache(kernel: None) -> None:
    for cache_dtype in QUANTIZED:
        for query_dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert cpu_ops.decode_attention_supports(query_dtype, cache_dtype)
        assert not cpu_ops.decode_attention_supports(torch.float64, cache_dtype)


def test_a_cache_without_room_for_the_scales_is_refused(kernel: None) -> None:
    case = make_case([5, 20], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)
    codes = with_changes(case, key_cache=case.key_cache.nan_to_num(0).to(torch.int8),
                         value_cache=case.value_cache.nan_to_num(0).to(torch.int8))
    with pytest.raises(RuntimeError, match="needs 66 \\(its values and their float16 scale\\)"):
        run_kernel(codes)


@pytest.mark.parametrize("cache_dtype", QUANTIZED, ids=IDS)
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_write_quantizes_each_token_and_head_as_torch_does(kernel: None, cache_dtype: torch.dtype, row_dtype: torch.dtype) -> None:
    head_dim = 40
    shape = (6, 4, 3, head_dim + 2)
    key_cache, value_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    qkv = (torch.randn(5, 9 * head_dim + 6 * head_dim, generator=torch.Generator().manual_seed(0)) * 30).to(row_dtype)
    qkv[1] = 0  # a zero row: scale 0, codes 0
    qkv[2, 9 * head_dim + 5] = 5e4  # one outlier sets its row's scale
    start = 9 * head_dim
    key, value = (qkv[:, start + i * 3 * head_dim : start + (i + 1) * 3 * head_dim].view(5, 3, head_dim) for i in range(2))
    slots = torch.tensor([23, 0, 7, 8, 16])
    cpu_ops.ops().write_kv_cache_(key_cache, value_cache, slots, key, value)
    for cache, rows in ((key_cache, key), (value_cache, value)):
        written = cache.view(-1, 3, head_dim + 2)[slots]
        assert torch.equal(written.view(torch.int8), quantize(rows, cache_dtype).view(torch.int8))
        # Each rotated value is off by at most: int8, half a step of absmax / 127; e4m3, 2^-4 of the
        # value or half its smallest step. Rotating back keeps the error's length.
        rotated = rotate(rows.float())
        absmax = rotated.abs().amax(dim=-1, keepdim=True)
        bound = absmax / 254 if cache_dtype == torch.int8 else torch.maximum(rotated.abs() / 16, absmax / 448 * 2**-10)
        error = (dequantize(written, torch.float32) - rows.float()).norm(dim=-1)
        assert bool((error <= bound.expand_as(rotated).norm(dim=-1) * 1.01 + 1e-5).all())
    assert int((key_cache.view(torch.int8) != 0).sum()) <= key.numel() + 2 * 5 * 3  # nothing but those slots


@pytest.mark.parametrize("head_dim,block", [(64, 64), (40, 8), (36, 4), (7, 1)])
def test_heads_are_rotated_by_an_orthonormal_hadamard_matrix_its_own_inverse(head_dim: int, block: int) -> None:
    matrix = rotate(torch.eye(head_dim))
    sylvester = torch.ones(1, 1)
    while sylvester.shape[0] < block:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)])
    assert torch.equal(matrix, torch.block_diag(*[sylvester / block**0.5] * (head_dim // block)))
    rows = torch.randn(5, head_dim)
    torch.testing.assert_close(rotate(rotate(rows)), rows)


def test_write_rejects_rows_of_the_wrong_width(kernel: None) -> None:
    key_cache = value_cache = torch.zeros(6, 4, 3, 10, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="must be \\[tokens, 3, 8\\]"):
        cpu_ops.ops().write_kv_cache_(key_cache, value_cache, torch.tensor([0]), torch.ones(1, 3, 10), torch.ones(1, 3, 10))
