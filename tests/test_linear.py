"""The small-batch C++ linear kernel against F.linear, and where the runner uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember_core.layers.linear import SMALL_BATCH_ROWS, SmallBatchLinear, tied_head, use_small_batch_linears
from tests.test_kernels import kernel  # noqa: F401 - the fixture that builds the extension or skips


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 33, SMALL_BATCH_ROWS])
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 200), (64, 384), (13, 7), (576, 49)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_computes_what_f_linear_computes(rows: int, in_features: int, out_features: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    actual = torch.ops.ember.small_batch_linear(x, weight, b)
    # float32 sums of up to 576 unit-scale products, added in another order than BLAS does
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=5e-5)


@pytest.mark.usefixtures("kernel")
def test_kernel_rejects_what_it_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="float32 only"):
        torch.ops.ember.small_batch_linear(torch.ones(2, 8, dtype=torch.float64), torch.ones(4, 8, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="must be \\[m, k\\] and weight \\[n, k\\]"):
        torch.ops.ember.small_batch_linear(torch.ones(2, 8), torch.ones(4, 9), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.ember.small_batch_linear(torch.ones(2, 8), torch.ones(4, 8), torch.ones(5))


@pytest.mark.usefixtures("kernel")
def test_layer_shares_the_weights_and_hands_big_batches_to_f_linear() -> None:
    embedding = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embedding, "proj": nn.Linear(16, 24), "head": tied_head(embedding)})
    weights = {name: p for name, p in model.named_parameters()}
    assert use_small_batch_linears(model) == 2
    assert isinstance(model["proj"], SmallBatchLinear) and isinstance(model["head"], SmallBatchLinear)
    assert dict(model.named_parameters()) == weights  # the same Parameter objects, tie included
    assert model["head"].weight is embedding.weight
    with torch.inference_mode():
        for rows in (3, SMALL_BATCH_ROWS + 7):  # the kernel, then F.linear
            x = torch.randn(rows, 16)
            expected = F.linear(x, model["proj"].weight, model["proj"].bias)
            torch.testing.assert_close(model["proj"](x), expected, rtol=1e-5, atol=1e-5)
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


@pytest.mark.usefixtures("kernel")
def test_bench_linear_times_every_candidate(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from ember_core.kernels import bench_linear

    monkeypatch.setattr("sys.argv", ["bench_linear", "--batches", "2", "--repeats", "1"])
    bench_linear.main()
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("batch    2")
    for name in bench_linear.candidates():
        assert f"{name}:" in row
