"""Every family from GGUF files written from the same random weights as llama.cpp's converter writes
them (ember_bench.gguf_export): an F32 file gives transformers' greedy tokens alone and batched, and a
Q8_0 file run from its blocks gives the greedy tokens of transformers holding the file's dequantized
weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import transformers

from ember_bench.gguf_export import export_gguf
from ember_core import LLM, SamplingParams
from ember_core.layers.linear import GGUFBlockLinear
from ember_core.loaders.gguf_loader import load_gguf
from ember_core.models.decoder import Decoder
from tests.families import FAMILIES, GGUF_OVERRIDES, token_prompts, transformers_greedy, write_checkpoint

PROMPT_LENGTHS = (3, 20, 70)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    model_dir = tmp_path_factory.mktemp(family)
    hf_model = write_checkpoint(family, model_dir, **GGUF_OVERRIDES.get(family, {}))
    return hf_model, {kind: export_gguf(model_dir, model_dir / f"model-{kind}.gguf", kind) for kind in ("F32", "Q8_0")}


def _ember_greedy(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(str(path), num_blocks=256, block_size=4, device="cpu", dtype="float32", numerics="exact")
    alone = [llm.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]
    return alone, [output.token_ids for output in llm.generate(prompts, GREEDY)]


def test_an_f32_file_gives_transformers_greedy_tokens(files) -> None:
    hf_model, paths = files
    prompts = token_prompts(PROMPT_LENGTHS)
    expected = [transformers_greedy(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    assert _ember_greedy(paths["F32"], prompts) == (expected, expected)


def _with_weights_of(hf_model: transformers.PreTrainedModel, model: Decoder) -> transformers.PreTrainedModel:
    """hf_model holding the float32 values ember expanded from a file, in the checkpoint's layout."""
    slots, params = model._weight_slots(), dict(model.named_parameters())
    offset = model.config.family.norm_weight_offset
    state = {}
    for name in hf_model.state_dict():
        key = name.removeprefix("model.")
        if key in slots:
            param, rows = slots[key]
            value = param.detach()[rows]
            state[name] = value - offset if key.endswith("norm.weight") else value
        elif key in params:  # transformers' stacked experts, in ember's layout
            state[name] = params[key].detach()
    reference = type(hf_model)(hf_model.config).eval()
    reference.load_state_dict(state, strict=False)
    reference.tie_weights()
    return reference


def test_a_q8_0_file_run_from_its_blocks_gives_the_greedy_tokens_of_its_values(files) -> None:
    hf_model, paths = files
    blocks, _, _ = load_gguf(paths["Q8_0"], torch.device("cpu"), torch.float32, keep_blocks=True)
    assert isinstance(blocks.layers[0].self_attn.qkv_proj, GGUFBlockLinear)
    dequantized, _, _ = load_gguf(paths["Q8_0"], torch.device("cpu"), torch.float32, keep_blocks=False)
    reference = _with_weights_of(hf_model, dequantized)
    prompts = token_prompts(PROMPT_LENGTHS, seed=7)
    expected = [transformers_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    original = hf_model.state_dict()
    assert any(not torch.equal(value, original[name]) for name, value in reference.state_dict().items())
    assert _ember_greedy(paths["Q8_0"], prompts) == (expected, expected)


def test_an_unknown_architecture_is_refused_naming_those_supported(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'mamba' is not supported; ember loads \[.*'gemma3'.*'qwen2'"):
        load_gguf(tmp_path / "mamba.gguf", torch.device("cpu"), torch.float32)


def test_an_unknown_model_type_is_refused_naming_those_supported(tmp_path: Path) -> None:
    write_checkpoint("llama", tmp_path / "model")
    config_path = tmp_path / "model" / "config.json"
    config_path.write_text(config_path.read_text().replace('"model_type": "llama"', '"model_type": "mamba"'))
    with pytest.raises(ValueError, match=r"unsupported model_type 'mamba'; ember supports \[.*'gemma3_text'.*'olmo2'"):
        LLM(str(tmp_path / "model"), dtype="float32", num_blocks=16)
