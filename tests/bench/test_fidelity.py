"""`ember bench fidelity` on the packaged SmolLM2 file: exact float32 is its own reference (KL 0),
fast lands near it, and llama-perplexity's statistics parse. On the best build this CPU runs (the
int8 kernel's own tests cover every build)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ember_bench.cli import main as bench_main
from ember_bench.fidelity import TEXT, compare
from ember_bench.llama_cpp_fidelity import parse_kl_statistics
from ember_core.kernels import cpu_ops
from ember_core.loaders.load import load_model

# The statistics llama-perplexity --kl-divergence printed for SmolLM2 Q4_1 on workloads/fidelity.txt (-c 1024)
LLAMA_PERPLEXITY_OUTPUT = """
0.00.276.379 I kl_divergence: computing over 7 chunks, n_ctx=1024, batch_size=2048, n_seq=2
====== Perplexity statistics ======
Mean PPL(Q)                   :   8.839753 ±   0.350072
Mean PPL(base)                :   8.790828 ±   0.347368
Cor(ln(PPL(Q)), ln(PPL(base))):  99.95%

====== KL divergence statistics ======
Mean    KLD:   0.002768 ±   0.000070
Maximum KLD:   0.195111
99.9%   KLD:   0.030066
99.0%   KLD:   0.011865
Median  KLD:   0.002120

====== Token probability statistics ======
Mean    Δp: -0.074 ± 0.023 %
Same top p: 96.813 ± 0.294 %
"""


needs_kernels = pytest.mark.skipif(not cpu_ops.is_available(), reason="fast runs on ember's C++ CPU ops")


@needs_kernels
def test_exact_float32_is_the_reference_and_fast_lands_near_it(smollm2_gguf_path: Path) -> None:
    cpu = torch.device("cpu")
    reference = load_model(str(smollm2_gguf_path), cpu, torch.float32, numerics="exact")
    tokens = reference.tokenizer.encode(TEXT.read_text())
    assert len(tokens) >= 4096  # the shipped text: 7,875 SmolLM2 tokens
    exact = compare(reference.model, reference.model, tokens, context=64, max_windows=2)
    assert (exact.scored_tokens, exact.kl.mean, exact.kl_max, exact.top1_agreement) == (2 * 31, 0.0, 0.0, 1.0)
    fast = load_model(str(smollm2_gguf_path), cpu, torch.float32, numerics="fast")
    measured = compare(reference.model, fast.model, tokens, context=64, max_windows=2)
    assert 0 < measured.kl.mean < 0.02 and measured.top1_agreement >= 0.9
    assert measured.reference_perplexity == exact.perplexity


@needs_kernels
def test_the_command_writes_its_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "fidelity.json"
    bench_main(["fidelity", "--context", "32", "--max-windows", "1", "--dtype", "bfloat16", "--output-json", str(output)])
    report = json.loads(output.read_text())
    figures = report["ember fast bfloat16"]
    assert figures["scored_tokens"] == 15 and figures["kl"]["mean"] > 0
    assert "| ember fast bfloat16 | 15 |" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--context", "2"], ["--text", str(tmp_path / "missing.txt")],
                 ["--kv-cache-dtype", "bfloat16", "--llama-cpp-dir", str(tmp_path)]):
        with pytest.raises(SystemExit) as exit_info:
            bench_main(["fidelity", *argv])
        assert exit_info.value.code == 2 and "ember bench: error:" in capsys.readouterr().err


def test_llama_perplexity_statistics_parse() -> None:
    figures = parse_kl_statistics(LLAMA_PERPLEXITY_OUTPUT)
    assert figures.scored_tokens == 7 * 511  # the second half of each window but its last position
    assert (figures.kl.mean, figures.kl_mean_error, figures.kl.median, figures.kl.p99) == (0.002768, 0.00007, 0.00212, 0.011865)
    assert figures.kl_max == 0.195111
    assert (figures.top1_agreement, figures.top1_error) == (pytest.approx(0.96813), pytest.approx(0.00294))
    assert (figures.reference_perplexity, figures.perplexity) == (8.790828, 8.839753)
    with pytest.raises(ValueError, match="printed no"):
        parse_kl_statistics("main: error: unable to load model")
