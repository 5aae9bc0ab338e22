"""`ember bench moe` on small shapes: both models run, and the experts a step read are counted
within what the routing allows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from ember_bench.moe_steps import run_moe_steps

SMALL = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
)


def test_moe_and_dense_steps_and_the_experts_read() -> None:
    steps = list(run_moe_steps("Q8_0", torch.float32, "float32", [1, 4], prompt_len=8, steps=3, rounds=2,
                               device=torch.device("cpu"), overrides=SMALL))
    assert [step.batch for step in steps] == [1, 4]
    # One expert's rows in Q8_0 (34 bytes a 32-value block): gate_up 64 x 64 values, down 64 x 32; 2 layers.
    gate_up_bytes, down_bytes = 64 * (64 // 32 * 34), 64 * (32 // 32 * 34)
    per_expert_mb = 2 * (gate_up_bytes + down_bytes) / 1e6
    for step in steps:
        assert step.moe_ms > 0 and step.dense_ms > 0
        assert 2 <= step.experts_per_layer <= min(2 * step.batch, 8)
        assert step.expert_mb_read == pytest.approx(step.experts_per_layer * per_expert_mb)
        assert step.all_experts_mb == pytest.approx(8 * per_expert_mb)
        assert step.per_token_mb == pytest.approx(2 * step.batch * per_expert_mb)
    assert steps[0].experts_per_layer == 2  # one token: exactly its top 2
