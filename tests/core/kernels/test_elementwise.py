"""ember's C++ RMSNorm, rotary and SwiGLU ops (ember_core/kernels/elementwise.cpp) against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember_core.kernels import cpu_ops
from ember_core.layers.activation import silu_and_mul
from ember_core.models.norm import RMSNorm
from ember_core.models.rotary import apply_rope, apply_rope_

pytestmark = pytest.mark.usefixtures("kernel")


@pytest.mark.parametrize("rows", [1, 5, 200])  # 200: the rows run in parallel
@pytest.mark.parametrize("dim", [576, 77])  # 77: past the last whole vector
def test_rms_norm_is_accurate_and_each_row_is_independent_of_the_batch(rows: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, dim, generator=generator) * 3
    weight = torch.rand(dim, generator=generator) + 0.5
    actual = cpu_ops.ops().rms_norm(x, weight, 1e-5)
    exact = (weight.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)).float()
    torch.testing.assert_close(actual, exact, rtol=2e-7, atol=1e-6)
    torch.testing.assert_close(actual, F.rms_norm(x, (dim,), weight, 1e-5), rtol=1e-6, atol=2e-6)
    for row in (0, rows - 1):
        assert torch.equal(cpu_ops.ops().rms_norm(x[row : row + 1].clone(), weight, 1e-5), actual[row : row + 1])


def test_llama_rms_norm_module_uses_it_for_float32_cpu_rows() -> None:
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(3, 64)
    assert torch.equal(norm(x), cpu_ops.ops().rms_norm(x, norm.weight, 1e-6))
    as_double = norm.double()(x.double())  # other dtypes keep the torch formula
    torch.testing.assert_close(as_double.float(), norm.float()(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 7, 130])
@pytest.mark.parametrize("head_dim", [64, 36])  # 36: half a head is not a whole number of vectors
def test_rotary_in_place_has_the_bits_of_apply_rope_on_a_strided_view(tokens: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 15 * head_dim, generator=generator)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q_and_k = qkv[:, : 12 * head_dim].view(tokens, 12, head_dim)  # the q/k columns of a fused QKV output
    expected = apply_rope(q_and_k, cos, sin)
    untouched = qkv[:, 12 * head_dim :].clone()
    assert apply_rope_(q_and_k, cos, sin) is q_and_k
    assert torch.equal(q_and_k, expected)
    assert torch.equal(qkv[:, 12 * head_dim :], untouched)


def test_rotary_falls_back_to_torch_for_other_dtypes() -> None:
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    cos, sin = torch.rand(4, 8, dtype=torch.float64), torch.rand(4, 8, dtype=torch.float64)
    expected = apply_rope(x, cos, sin)
    assert torch.equal(apply_rope_(x, cos, sin), expected)


@pytest.mark.parametrize("rows,width", [(1, 3072), (16, 3072), (200, 3072), (3, 2 * 13)])
def test_silu_and_mul_matches_torch(rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, width, generator=generator) * 6
    # Saturated and underflowing gates: silu(-100) is -0 in torch, silu(100) is 100.
    gate_up[0, :6] = torch.tensor([-100.0, -87.5, -20.0, 0.0, 20.0, 100.0])
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    actual = cpu_ops.ops().silu_and_mul(gate_up)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-30)
    assert torch.equal(silu_and_mul(gate_up), actual)
    as_double = silu_and_mul(gate_up.double())  # other dtypes keep the torch formula
    torch.testing.assert_close(as_double, F.silu(gate.double()) * up.double())


def test_ops_reject_what_they_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="x must be a float32 or bfloat16 CPU tensor"):
        cpu_ops.ops().rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="x must be a contiguous \\[rows, 8\\] tensor"):
        cpu_ops.ops().rms_norm(torch.ones(2, 9), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="even head_dim"):
        cpu_ops.ops().rotary_(torch.ones(2, 3, 7), torch.ones(2, 7), torch.ones(2, 7))
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous \\[2, 8\\]"):
        cpu_ops.ops().rotary_(torch.ones(2, 3, 8), torch.ones(3, 8), torch.ones(3, 8))
    with pytest.raises(RuntimeError, match="gate_up must be a contiguous \\[rows, 2 \\* n\\] tensor"):
        cpu_ops.ops().silu_and_mul(torch.ones(2, 7))
