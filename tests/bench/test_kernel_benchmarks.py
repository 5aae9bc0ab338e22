"""The kernel benchmarks (python -m ember_bench.kernel_linear / kernel_attention) run."""

from __future__ import annotations

import pytest

from ember_bench import kernel_linear
from tests.core.test_kernels import kernel  # noqa: F401 - the fixture that builds the extension or skips


@pytest.mark.usefixtures("kernel")
def test_the_linear_kernel_benchmark_times_every_candidate(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["kernel_linear", "--batches", "2", "--repeats", "1"])
    kernel_linear.main()
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("batch    2")
    for name in kernel_linear.candidates():
        assert f"{name}:" in row
