"""The scheduler's charge for a prompt token's attention over earlier positions, from the model's shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_core import LLM
from ember_core.layers.linear import SMALL_BATCH_ROWS
from ember_core.runner.context_cost import context_cost_per_position


def test_gpt2_cost_is_one_over_twice_hidden_plus_inner(gpt2_dir: Path) -> None:
    # Per layer: QK^T + PV = 2 h per position; c_attn, attn_proj, c_fc, mlp_proj = 4 h^2 + 2 h i per token.
    llm = LLM(str(gpt2_dir), block_size=4, num_blocks=64, dtype="float32", device="cpu")
    hidden, inner = 64, 4 * 64
    assert context_cost_per_position(llm.engine.runner.model) == pytest.approx(1 / (2 * hidden + inner))
    assert llm.engine.scheduler.context_cost == pytest.approx(1 / (2 * hidden + inner))
    assert llm.engine.scheduler.min_chunk_tokens == SMALL_BATCH_ROWS + 1  # no chunk of a few tokens
