"""FlexAttention decode over the paged cache (the path for devices without ember's C++ kernel),
run here on the CPU: it must equal SDPA over gathered blocks and keep greedy tokens, and its
start-up check must reject a path that computes something else."""

from __future__ import annotations

import pytest
import torch

from ember_core.layers.attention import PagedAttention, decode_key_mask, gathered_decode_attention
from ember_core.layers.flex_decode import decode_block_mask, flex_decode_attention, padded_rows
from ember_core.runner import decode_attention
from ember_core.runner.decode_attention import choose_decode_attention
from tests.core.package.test_invariance import GREEDY, PROMPTS, make_llm

BLOCK_SIZE = 16
NUM_BLOCKS = 40


def _random_decodes(context_lens: list[int], num_heads: int, num_kv_heads: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, 64)
    key_cache, value_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    max_blocks = max(-(-n // BLOCK_SIZE) for n in context_lens)
    # Blocks handed out in scrambled order, the padding after a row's blocks pointing at block 0.
    order = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = []
    for n in context_lens:
        held = [order.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables.append(held + [0] * (max_blocks - len(held)))
    query = torch.randn(len(context_lens), num_heads, 64, generator=generator)
    return query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4)])
def test_flex_decode_equals_sdpa_over_gathered_blocks(num_heads: int, num_kv_heads: int) -> None:
    # Lengths around block edges, padded from 6 rows to 8.
    context_lens = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5, 2 * BLOCK_SIZE]
    query, key_cache, value_cache, tables, lens = _random_decodes(context_lens, num_heads, num_kv_heads)
    max_blocks = tables.shape[1]
    with torch.inference_mode():
        got = flex_decode_attention(query, key_cache, value_cache, decode_block_mask(tables, lens, NUM_BLOCKS, BLOCK_SIZE), 0.125)
        want = gathered_decode_attention(query, key_cache, value_cache, tables, decode_key_mask(lens, max_blocks, BLOCK_SIZE), 0.125)
    assert got.shape == want.shape == query.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_rows_are_padded_to_powers_of_two() -> None:
    assert [padded_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 16, 128]


def test_engine_on_flex_decode_gives_the_kernels_greedy_tokens(gpt2_dir) -> None:
    kernel = make_llm(gpt2_dir)
    flex = make_llm(gpt2_dir, decode_attention="flex")
    assert kernel.engine.runner.decode_attention == "kernel"
    assert flex.engine.runner.decode_attention == "flex"
    assert [o.token_ids for o in flex.generate(PROMPTS, GREEDY)] == [o.token_ids for o in kernel.generate(PROMPTS, GREEDY)]


def _layer_with_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> PagedAttention:
    layer = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=64)
    layer.key_cache = torch.zeros(8, BLOCK_SIZE, 2, 64, dtype=cache_dtype)
    layer.value_cache = torch.zeros_like(layer.key_cache)
    return layer


def test_start_up_check_rejects_a_flex_path_that_computes_something_else(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer_with_cache(torch.float32, torch.float32)
    assert choose_decode_attention("flex", [layer], torch.float32) == "flex"
    assert torch.count_nonzero(layer.key_cache) == 0  # the check's noise is cleared
    monkeypatch.setattr(decode_attention, "flex_decode_attention", lambda q, *args: q * 2)
    with pytest.raises(ValueError, match="'flex' does not work here: AssertionError"):
        choose_decode_attention("flex", [layer], torch.float32)
    assert torch.count_nonzero(layer.key_cache) == 0


def test_explicit_choices_that_cannot_run_here_say_why() -> None:
    with pytest.raises(ValueError, match="needs the KV cache in the model's dtype"):
        choose_decode_attention("flex", [_layer_with_cache(torch.float32, torch.float16)], torch.float32)
    with pytest.raises(ValueError, match="'kernel' needs ember's C\\+\\+ ops on the CPU for a torch.float16 model over a torch.bfloat16"):
        choose_decode_attention("kernel", [_layer_with_cache(torch.float16, torch.bfloat16)], torch.float16)
    assert choose_decode_attention("sdpa", [_layer_with_cache(torch.float32, torch.float32)], torch.float32) == "sdpa"


def test_config_rejects_an_unknown_decode_attention(gpt2_dir) -> None:
    with pytest.raises(ValueError, match="decode_attention must be one of auto, kernel, flex, sdpa"):
        make_llm(gpt2_dir, decode_attention="triton")

