"""A GGUF file split over tensor-parallel ranks, each rank taking its rows and columns of the file's
blocks: an F32 file gives transformers' float32 greedy tokens, a Q8_0 file the tokens it gives in one
process, and the real SmolLM2 Q4_1 file over three ranks (its 9 heads) the text it gives in one. A
rank whose columns of a tensor cut the file's blocks keeps that part as dequantized rows."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from ember_bench.gguf_export import export_gguf
from ember_core import LLM, SamplingParams
from ember_core.layers.linear import GGUFBlockLinear
from ember_core.loaders.gguf_blocks import BlockRows, MisalignedColumns
from tests.families import GGUF_OVERRIDES, token_prompts, write_checkpoint
from tests.reference import reference_greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = token_prompts((5, 19, 11))


def _greedy(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    alone = [llm.generate([prompt], GREEDY)[0].outputs[0].token_ids for prompt in prompts]
    return alone, [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]


def _file(family: str, kind: str, path: Path, **overrides: int):
    reference = write_checkpoint(family, path, **GGUF_OVERRIDES.get(family, {}), **overrides)
    return reference, export_gguf(path, path / f"model-{kind}.gguf", kind)


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2", "qwen2_moe"])
def test_an_f32_file_over_two_ranks_gives_transformers_greedy_tokens(family: str, tmp_path: Path) -> None:
    reference, path = _file(family, "F32", tmp_path)
    expected = [reference_greedy(reference, prompt, MAX_TOKENS) for prompt in PROMPTS]
    with LLM(str(path), dtype="float32", num_blocks=64, tensor_parallel_size=2) as llm:
        assert _greedy(llm, PROMPTS) == (expected, expected)


@pytest.mark.parametrize(("family", "intermediate_size"), [("llama", 128), ("llama", 96), ("mixtral", 96)])
def test_a_q8_0_file_over_two_ranks_gives_its_one_process_tokens(family: str, intermediate_size: int, tmp_path: Path) -> None:
    _, path = _file(family, "Q8_0", tmp_path, intermediate_size=intermediate_size)
    options = dict(dtype="float32", num_blocks=64, numerics="exact")
    one_process = _greedy(LLM(str(path), **options), PROMPTS)
    with LLM(str(path), **options, tensor_parallel_size=2) as llm:
        assert _greedy(llm, PROMPTS) == one_process
        layer = llm.engine.runner.model.layers[0]
    # q/k/v rows split anywhere; o's 2 heads of 16 columns a rank are one Q8_0 block of 32
    assert isinstance(layer.self_attn.qkv_proj, GGUFBlockLinear)
    assert isinstance(layer.self_attn.o_proj, GGUFBlockLinear)
    if family == "llama":  # down's 64 columns a rank are two blocks; 48 cut the second one
        assert isinstance(layer.mlp.down_proj, GGUFBlockLinear) == (intermediate_size == 128)


def test_block_rows_take_whole_blocks_of_columns() -> None:
    blocks = torch.arange(4 * 3 * 34, dtype=torch.uint8).view(4, 3 * 34)  # Q8_0: 34 bytes per 32 columns
    rows = BlockRows(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert rows.get_shape() == (4, 96)
    assert torch.equal(rows[1:3], blocks[1:3])
    assert torch.equal(rows[:, slice(32, 96)], blocks[:, 34:])
    with pytest.raises(MisalignedColumns, match="columns 0:48 cut Q8_0's 32-wide blocks"):
        rows[:, slice(0, 48)]


def test_the_real_smollm2_file_over_three_ranks_gives_its_one_process_text() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    options = dict(dtype="float32", num_blocks=64, numerics="exact")
    one_process = [output.outputs[0].text for output in LLM("smollm2-135m-instruct", **options).generate(prompts, greedy)]
    with LLM("smollm2-135m-instruct", **options, tensor_parallel_size=3) as llm:
        split = [output.outputs[0].text for output in llm.generate(prompts, greedy)]
        down = llm.engine.runner.model.layers[0].mlp.down_proj
    assert split == one_process
    assert isinstance(down, GGUFBlockLinear) and down.in_features == 1536 // 3
