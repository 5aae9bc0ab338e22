"""The speculative decoding benchmark's pieces: its prompts and its report's ratios."""

from __future__ import annotations

from pathlib import Path

from ember_bench.spec_decode import ASKS, LLAMA, PLAIN, SPEC, Round, copy_requests, report
from tests.bench.test_llama_cpp_compare import metrics


def test_the_copy_prompts_are_chat_prompts_of_the_model(smollm2_gguf_path: Path) -> None:
    requests = copy_requests(smollm2_gguf_path, 32)
    assert len(requests) == len(ASKS)
    for request, ask in zip(requests, ASKS):
        assert ask in request.prompt and request.prompt.startswith("<|im_start|>") and request.max_tokens == 32


def test_the_report_divides_each_servers_figures(smollm2_gguf_path: Path) -> None:
    rounds = [
        Round(1, PLAIN, metrics(50.0, tpot_ms=15.0), ["a"], metrics(200.0)),
        Round(1, SPEC, metrics(100.0, tpot_ms=6.0), ["a"], metrics(190.0)),
        Round(1, LLAMA, metrics(80.0, tpot_ms=10.0), ["b"], None),
    ]
    text = report(rounds, smollm2_gguf_path)
    assert "ngram / without: 0.40x" in text
    assert "ngram / llama-server: 0.60x" in text
    assert "per round: 0.950x" in text
    assert "the same with and without drafts: yes" in text
