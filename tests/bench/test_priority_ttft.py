"""The priority check on a small scale: a full engine starts the high-priority burst first."""

from __future__ import annotations

from pathlib import Path

from ember_bench.priority_ttft import run


def test_high_priority_requests_start_before_low_ones_arriving_with_them(smollm2_gguf_path: Path) -> None:
    result = run(str(smollm2_gguf_path), streams=6, burst=2, stream_tokens=48, burst_tokens=2, warm_steps=3,
                 max_num_seqs=4)
    assert result.high_ttft_p50_s < result.low_ttft_p50_s and result.preemptions >= 2
