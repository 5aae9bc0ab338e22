"""oneDNN pre-packed linear layers against nn.Linear, and where the runner uses them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember_core.layers.linear import PackedLinear, can_pack, pack_linears, tied_head

CPU = torch.device("cpu")


def test_float32_cpu_weights_can_be_packed() -> None:
    # Every torch CPU build this project installs has oneDNN; without it the tests below prove nothing.
    assert can_pack(CPU, torch.float32)
    assert not can_pack(CPU, torch.float64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_packed_linear_computes_what_linear_computes(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, linear.weight.detach())


def test_pack_linears_replaces_every_linear_and_keeps_a_tied_embedding() -> None:
    embedding = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embedding, "proj": nn.Linear(16, 16), "head": tied_head(embedding)})
    assert model["head"].weight is embedding.weight
    expected_logits = model["head"](torch.ones(2, 16)).detach()
    assert pack_linears(model) == 2
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert isinstance(model["embed"].weight, nn.Parameter)  # lookups still read the plain weight
    with torch.inference_mode():
        torch.testing.assert_close(model["head"](torch.ones(2, 16)), expected_logits)


def test_pack_linears_leaves_a_model_it_cannot_pack_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8).double())
    assert pack_linears(model) == 0
    assert isinstance(model[0], nn.Linear)


def test_engine_serves_float32_cpu_models_through_packed_layers(gpt2_llm) -> None:
    """So the exactness tests against transformers run through the packed path."""
    model = gpt2_llm.engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
