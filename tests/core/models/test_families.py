"""Every model family against transformers' own class of it, with random weights, in float32: greedy
tokens alone and batched; and ember's invariances for each family, in float32 and bfloat16: block
size, batch, preemption, chunked prefill and the prefix cache never change a request's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from ember_core import LLM, SamplingParams
from ember_core.cache import BlockManager
from ember_core.loaders import load_model
from ember_core.models.decoder import Decoder
from tests.conftest import assert_pool_free
from tests.families import FAMILIES, WINDOW, token_prompts, transformers_greedy, write_checkpoint

# 150 > SMALL_BATCH_ROWS: that prompt's prefill takes the batched SDPA path; every prompt is longer
# than the windows; Phi-3's LongRoPE turns its long table on past 64 positions.
PROMPT_LENGTHS = (1, 9, 70, 150)
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, transformers.PreTrainedModel]:
    family = request.param
    model_dir = tmp_path_factory.mktemp(family)
    return family, model_dir, write_checkpoint(family, model_dir)


def test_the_family_loads_as_the_one_decoder_with_its_switches(checkpoint) -> None:
    family, model_dir, hf_model = checkpoint
    model = load_model(str(model_dir), torch.device("cpu"), torch.float32).model
    assert isinstance(model, Decoder)
    windows = [layer.sliding_window for layer in model.config.layers]
    layer_types = getattr(hf_model.config, "layer_types", None) or ["full_attention"] * len(windows)
    expected = [WINDOW if kind == "sliding_attention" else None for kind in layer_types]
    if family in ("mistral", "mixtral", "qwen3_moe"):  # every layer slides
        expected = [WINDOW] * len(windows)
    assert windows == expected


def test_greedy_tokens_equal_transformers_alone_and_batched(checkpoint) -> None:
    _, model_dir, hf_model = checkpoint
    prompts = token_prompts(PROMPT_LENGTHS)
    expected = [transformers_greedy(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    llm = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32")
    alone = [llm.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]
    batched = [output.token_ids for output in llm.generate(prompts, GREEDY)]
    assert alone == expected
    assert batched == expected
    assert_pool_free(llm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_size_batch_preemption_chunks_and_prefix_cache_do_not_change_tokens(checkpoint, dtype: str) -> None:
    """Prompts within the small-batch rows, whose steps keep every row's bits: tokens and logprobs."""
    _, model_dir, _ = checkpoint
    prompts = token_prompts((5, 17, 40, 60, 33), seed=99)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = LLM(str(model_dir), num_blocks=512, block_size=16, device="cpu", dtype=dtype, enable_prefix_caching=False)
    alone = [(output.token_ids, output.logprobs) for output in (plain.generate([prompt], params)[0] for prompt in prompts)]
    assert len({tuple(tokens) for tokens, _ in alone}) == len(prompts)
    # Blocks of 3, a pool that holds the longest request alone and a third more, prompts cut into
    # chunks of at most 20 tokens; a preempted request starts again from its cached blocks.
    windows = plain.engine.block_manager.group_windows
    pool = int(BlockManager(1, 3, windows).blocks_for_sequence(max(map(len, prompts)) + params.max_tokens, 20) * 1.3)
    squeezed = LLM(
        str(model_dir), num_blocks=pool, block_size=3, device="cpu", dtype=dtype, max_num_batched_tokens=20, max_num_seqs=8
    )
    assert [(output.token_ids, output.logprobs) for output in squeezed.generate(prompts, params)] == alone
    if 2 * windows.count(None) >= len(windows):
        # Where window groups dominate, a request admitted for its prompt's peak holds far less once
        # it decodes, and the pool rarely runs out (the scheduler's own tests preempt those).
        assert squeezed.stats().num_preemptions > 0, "the pool must be squeezed enough to preempt"
    assert_pool_free(squeezed)
    # Every prompt again, from the blocks the first round left cached.
    cached = LLM(str(model_dir), num_blocks=512, block_size=3, device="cpu", dtype=dtype)
    for _ in range(2):
        assert [(output.token_ids, output.logprobs) for output in cached.generate(prompts, params)] == alone
    assert cached.stats().num_prefix_cache_hits >= sum(len(prompt) - 3 for prompt in prompts)
    assert_pool_free(cached)
