"""The context a request may use is capped by what one sequence can hold in the KV cache, so a
request is either rejected up front or runs to its max_tokens; never cut off by a full pool."""

from __future__ import annotations

import logging

import pytest

from ember_core import LLM, SamplingParams
from ember_core.engine.engine import RequestRejected

CACHE_TOKENS = 32  # 8 blocks of 4; the test GPT-2 has 256 positions


def test_max_model_len_is_lowered_to_the_cache_and_says_so(gpt2_dir, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(gpt2_dir), device="cpu", dtype="float32", block_size=4, num_blocks=8)
    assert llm.engine.max_model_len == CACHE_TOKENS
    assert "max_model_len lowered from the model's 256 to the KV cache's 32 tokens" in caplog.text
    with pytest.raises(RequestRejected, match="exceeds the model context of 32 tokens"):
        llm.generate([list(range(1, 11))], SamplingParams(max_tokens=23, ignore_eos=True))
    # The largest request that fits runs to its max_tokens instead of stopping when the pool is full.
    output = llm.generate([list(range(1, 11))], SamplingParams(max_tokens=22, ignore_eos=True))[0]
    assert len(output.token_ids) == 22


def test_an_explicit_max_model_len_over_the_models_positions_is_refused_at_start(gpt2_dir) -> None:
    with pytest.raises(ValueError, match="max_model_len 512 exceeds the model's context of 256 positions"):
        LLM(str(gpt2_dir), device="cpu", dtype="float32", block_size=4, num_blocks=256, max_model_len=512)


def test_an_explicit_max_model_len_over_the_cache_is_refused_at_start(gpt2_dir) -> None:
    with pytest.raises(ValueError, match="max_model_len 64 exceeds the KV cache's 32 tokens"):
        LLM(str(gpt2_dir), device="cpu", dtype="float32", block_size=4, num_blocks=8, max_model_len=64)
    assert LLM(str(gpt2_dir), device="cpu", dtype="float32", block_size=4, num_blocks=8, max_model_len=20).engine.max_model_len == 20
