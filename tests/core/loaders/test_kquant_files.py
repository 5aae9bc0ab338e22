"""GGUF files quantized by llama.cpp's own `llama-quantize` to its Q4_K_M, Q5_K_M and Q3_K_M mixes
(tests/core/data/kquants: Q4_K/Q5_K/Q3_K beside Q6_K, and Q5_0/Q8_0 where rows are not whole
super-blocks), so a fused QKV or gate/up mixes formats (StackedBlockLinear). In float32 and bfloat16,
prompts of 1 to 2,000 tokens run alone, batched, in chunks and on prefix-cache hits, and give the same
greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_core import LLM, SamplingParams
from ember_core.layers.linear import StackedBlockLinear
from ember_core.loaders.gguf_loader import load_gguf
from tests.core.data.kquants.make_kquant_files import COMMON, SHAPES
from tests.core.loaders.test_families_gguf import MAX_TOKENS, _with_weights_of
from tests.families import VOCAB, hf_model, transformers_greedy

KQUANTS = Path(__file__).parents[1] / "data" / "kquants"
FILES = sorted(KQUANTS.glob("*.gguf"))
PROMPT_LENGTHS = (1, 7, 129, 300, 2000)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def test_the_files_mix_formats_in_one_fused_linear() -> None:
    assert len(FILES) == 5
    model, _, _ = load_gguf(KQUANTS / "qwen2-Q4_K_M.gguf", torch.device("cpu"), torch.float32, keep_blocks=True)
    assert any(isinstance(module, StackedBlockLinear) for module in model.modules())


@pytest.mark.parametrize("numerics", ["exact", "fast"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_alone_batched_chunked_and_cached_give_the_same_tokens(path: Path, dtype: str, numerics: str) -> None:
    prompts = _prompts()
    settings = dict(dtype=dtype, device="cpu", num_blocks=1024, block_size=16, numerics=numerics)
    llm = LLM(str(path), max_num_batched_tokens=4096, **settings)
    alone = []
    for prompt in prompts:
        llm.reset_prefix_cache()
        alone.append(llm.generate([prompt], GREEDY)[0].token_ids)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in alone)
    assert [output.token_ids for output in llm.generate(prompts, GREEDY)] == alone, "batched, on prefix hits"
    llm.reset_prefix_cache()
    assert [output.token_ids for output in llm.generate(prompts, GREEDY)] == alone, "batched"
    chunked = LLM(str(path), max_num_batched_tokens=200, **settings)
    assert [output.token_ids for output in chunked.generate(prompts, GREEDY)] == alone, "in chunks"


@pytest.mark.parametrize("path", [KQUANTS / "llama-Q4_K_M.gguf", KQUANTS / "qwen2-Q4_K_M.gguf"], ids=lambda path: path.stem)
def test_float32_gives_the_greedy_tokens_of_transformers_holding_the_files_values(path: Path) -> None:
    family = path.stem.rsplit("-", 1)[0]
    dequantized, _, _ = load_gguf(path, torch.device("cpu"), torch.float32, keep_blocks=False)
    reference = _with_weights_of(hf_model(family, **COMMON, **SHAPES[family]), dequantized)
    prompts = _prompts()[:4]
    expected = [transformers_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=256, block_size=16, numerics="exact")
    assert [output.token_ids for output in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))] == expected
