"""A model split over two tensor-parallel ranks (the engine and a follower process it starts)
generates transformers' float32 greedy tokens in every family, GPT-2 and the mixtures of experts
included, alone and in a batch, and over four ranks where the heads allow, with the follower
holding about half the weights; a size that does not split, LoRA, or a GPU is refused in one
line; a follower that dies takes the engine's next step down with RankLost, not a hang."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import transformers

from ember_core import LLM, SamplingParams
from ember_core.models.decoder_config import DecoderConfig
from ember_core.parallel.group import TensorParallel
from ember_core.parallel.rank_lost import RankLost
from ember_core.parallel.shards import DecoderShards
from tests.conftest import write_gpt2_checkpoint
from tests.families import FAMILIES, token_prompts, write_checkpoint
from tests.reference import reference_greedy

MAX_TOKENS = 8


def _generates_transformers_greedy_tokens(family: str, ranks: int, path: Path) -> None:
    reference = write_checkpoint(family, path)
    prompts = token_prompts((5, 19, 11))
    expected = [reference_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(path), dtype="float32", num_blocks=64, tensor_parallel_size=ranks) as llm:
        alone = [llm.generate([prompt], greedy)[0].outputs[0].token_ids for prompt in prompts]
        batched = [output.outputs[0].token_ids for output in llm.generate(prompts, greedy)]
    assert alone == expected
    assert batched == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_ranks_generate_transformers_greedy_tokens(family: str, tmp_path: Path) -> None:
    _generates_transformers_greedy_tokens(family, 2, tmp_path)


# One query head a rank, and each of the 2 K/V heads held by two ranks (OLMo 2's k norm counts it once).
@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "mixtral", "qwen2_moe"])
def test_four_ranks_generate_transformers_greedy_tokens(family: str, tmp_path: Path) -> None:
    _generates_transformers_greedy_tokens(family, 4, tmp_path)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_over_two_ranks_generates_transformers_greedy_tokens(tied: bool, tmp_path: Path) -> None:
    write_gpt2_checkpoint(tmp_path, n_inner=96, tie_word_embeddings=tied)
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    prompts = token_prompts((5, 19, 11))
    expected = [reference_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(tmp_path), dtype="float32", num_blocks=64, tensor_parallel_size=2) as llm:
        alone = [llm.generate([prompt], greedy)[0].outputs[0].token_ids for prompt in prompts]
        batched = [output.outputs[0].token_ids for output in llm.generate(prompts, greedy)]
        block = llm.engine.runner.model.blocks[0]
    assert alone == expected
    assert batched == expected
    assert block.c_attn.weight.shape == (3 * 32, 64) and block.mlp_proj.weight.shape == (64, 48)  # 2 of 4 heads


def test_each_rank_holds_its_part_of_the_weights(tmp_path: Path) -> None:
    write_checkpoint("llama", tmp_path)
    whole = LLM(str(tmp_path), dtype="float32", num_blocks=16).engine.runner.model
    with LLM(str(tmp_path), dtype="float32", num_blocks=16, tensor_parallel_size=2) as llm:
        part = llm.engine.runner.model
        sizes = {name: tuple(param.shape) for name, param in part.named_parameters()}
    config: DecoderConfig = whole.config
    # 4 heads of 16 dims and 2 KV heads: 2 + 1 + 1 heads of rows; the MLP's 96 rows, the 311-token
    # vocabulary (156 rows, the second rank's last one padding)
    assert sizes["layers.0.self_attn.qkv_proj.weight"] == (4 * config.head_dim, config.hidden_size)
    assert sizes["layers.0.self_attn.o_proj.weight"] == (config.hidden_size, 2 * config.head_dim)
    assert sizes["layers.0.mlp.gate_up_proj.weight"] == (96, config.hidden_size)
    assert sizes["layers.0.mlp.down_proj.weight"] == (config.hidden_size, 48)
    assert sizes["embed_tokens.weight"] == (156, config.hidden_size)
    half = sum(p.numel() for p in part.parameters()) / sum(p.numel() for p in whole.parameters())
    assert 0.5 <= half < 0.55, half  # norms are whole on every rank


def test_a_kv_head_shared_by_both_ranks_is_held_by_each() -> None:
    hf = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 1}  # fmt: skip
    config = DecoderConfig.from_hf(hf)
    k = torch.arange(config.head_dim * 8).view(config.head_dim, 8)
    for rank in (0, 1):
        shards = DecoderShards(config, TensorParallel(rank, 2))
        assert shards.local_config().num_kv_heads == 1
        assert torch.equal(shards.take("model.layers.0.self_attn.k_proj.weight", k), k)


def test_what_does_not_split_is_refused_in_one_line(tmp_path: Path) -> None:
    write_checkpoint("llama", tmp_path / "llama", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide its 4 attention heads"):
        LLM(str(tmp_path / "llama"), dtype="float32", num_blocks=16, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="LoRA adapters are not split"):
        LLM(str(tmp_path / "llama"), tensor_parallel_size=2, enable_lora=True)



def test_ranks_on_a_gpu_are_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before anything touches the GPU
    with pytest.raises(ValueError, match="tensor parallelism runs CPU ranks so far .* not cuda"):
        LLM(str(tmp_path), tensor_parallel_size=2, device="cuda")


def test_a_follower_that_dies_fails_the_next_step(tmp_path: Path) -> None:
    write_checkpoint("llama", tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path), dtype="float32", num_blocks=16, tensor_parallel_size=2) as llm:
        assert llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
        follower = llm.engine.ranks.processes[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=30)
        with pytest.raises(RankLost):
            llm.engine.check_ranks()
        with pytest.raises(RankLost):
            llm.generate([[5, 6, 7]], greedy)
