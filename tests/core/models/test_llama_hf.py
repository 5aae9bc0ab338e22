"""ember's decoder as Llama against transformers on small random-weight HF checkpoints, in float32."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from ember_core import LLM, SamplingParams
from ember_core.layers.block_embedding import GGUFBlockEmbedding
from ember_core.layers.linear import GGUFBlockLinear
from ember_core.loaders import load_model
from ember_core.models.decoder import Decoder
from ember_core.models.decoder_config import DecoderConfig
from ember_core.models.rotary import RopeScaling
from ember_core.runner.inputs import SequenceChunk
from ember_core.runner.model_runner import ModelRunner

VOCAB = 509
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that head_dim 16 has frequencies in all three llama3 bands.
    "original_max_position_embeddings": 64,
}
CASES = {
    "gqa_tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "mha_untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "mqa_llama3_rope": dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE, eos_token_id=[2, 7]),
    "linear_rope_biases": dict(
        num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
        attention_bias=True,
        mlp_bias=True,
    ),
    "sharded": dict(num_key_value_heads=2, num_hidden_layers=3),
    # Saved in bfloat16, as most HF checkpoints are; ember runs it in float32 from its 16-bit rows.
    "bfloat16_checkpoint": {"num_key_value_heads": 2, "attention_bias": True},
}
PROMPT_LENGTHS = (1, 6, 19, 33)
BLOCK_SIZE = 4


def _hf_model(case: str, **overrides) -> transformers.LlamaForCausalLM:
    defaults = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    )
    config = transformers.LlamaConfig(**{**defaults, **overrides})
    torch.manual_seed(sorted(CASES).index(case))
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Larger than the default init, and norm weights away from 1, so every weight shows in the logits.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, transformers.LlamaForCausalLM]:
    case = request.param
    model = _hf_model(case, **CASES[case])
    model_dir = tmp_path_factory.mktemp(case)
    saved = model
    if case == "bfloat16_checkpoint":
        with torch.no_grad():  # the reference: the bf16 values in float32 (its rotary buffers stay float32)
            for param in model.parameters():
                param.copy_(param.bfloat16())
        saved = copy.deepcopy(model).bfloat16()
    saved.save_pretrained(model_dir, safe_serialization=True, max_shard_size="40KB" if case == "sharded" else "1GB")
    assert (model_dir / "model.safetensors.index.json").is_file() == (case == "sharded")
    return model_dir, model


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _reference_logits(model: transformers.LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def test_config_from_hf_checkpoint(checkpoint: tuple[Path, transformers.LlamaForCausalLM]) -> None:
    model_dir, hf_model = checkpoint
    loaded = load_model(str(model_dir), torch.device("cpu"), torch.float32)
    config: DecoderConfig = loaded.model.config
    hf_config = hf_model.config
    assert config.num_kv_heads == hf_config.num_key_value_heads
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    eos = hf_config.eos_token_id
    assert config.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    assert set(config.eos_token_ids) <= loaded.stop_token_ids


def test_logits_match_transformers_in_a_mixed_batch(checkpoint: tuple[Path, transformers.LlamaForCausalLM]) -> None:
    """Every prompt position, computed in steps that mix whole prompts, prompt chunks resuming at an
    offset and single-token decodes at different positions, as the scheduler batches them."""
    model_dir, hf_model = checkpoint
    model = load_model(str(model_dir), torch.device("cpu"), torch.float32).model
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    prompts = _prompts()
    next_block = iter(range(64))
    tables = [[next(next_block) for _ in range(-(-len(p) // BLOCK_SIZE))] for p in prompts]
    # Per step, per prompt (lengths 1, 6, 19, 33): how many of its tokens run; 1 is the decode path.
    schedule = [[1, 5, 10, 33], [0, 1, 1, 0], [0, 0, 8, 0]]
    done = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in schedule:
        chunks, owners = [], []
        for index, count in enumerate(step):
            if count:
                start = done[index]
                chunks.append(SequenceChunk(prompts[index][start : start + count], start, [tables[index]]))
                owners.append(index)
                done[index] += count
        with torch.inference_mode():
            logits = model.compute_logits(runner.forward_hidden(chunks))
        for chunk, index, part in zip(chunks, owners, logits.split([len(c.token_ids) for c in chunks])):
            rows[index].append(part)
    assert done == [len(p) for p in prompts], "the schedule must cover every prompt"
    for prompt, parts in zip(prompts, rows):
        expected = _reference_logits(hf_model, prompt)
        torch.testing.assert_close(torch.cat(parts), expected, rtol=0, atol=1e-4)


def test_greedy_continuations_match_transformers(checkpoint: tuple[Path, transformers.LlamaForCausalLM]) -> None:
    model_dir, hf_model = checkpoint
    prompts = _prompts()
    llm = LLM(str(model_dir), num_blocks=96, block_size=BLOCK_SIZE, device="cpu", dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    # eos_token_id=None would fall back to the model's EOS; an empty list really disables stopping, like ignore_eos.
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation)[0, len(prompt) :]
        assert output.token_ids == expected.tolist() and len(expected) == 16


def test_config_from_hf_rejects_what_it_cannot_run() -> None:
    base = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 16,
    }  # fmt: skip
    with pytest.raises(ValueError, match="rope scaling type 'dynamic'"):
        DecoderConfig.from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="activation 'relu'"):
        DecoderConfig.from_hf({**base, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        DecoderConfig.from_hf({**base, "num_key_value_heads": 3})
    old_style = DecoderConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    rope = old_style.layers[0].rope
    assert (rope.theta, rope.scaling) == (5e5, RopeScaling("linear", 2.0))


def test_load_weights_names_the_tensor_that_does_not_fit() -> None:
    hf_model = _hf_model("gqa_tied", num_key_value_heads=2, tie_word_embeddings=False)
    weights = dict(hf_model.state_dict())
    model = Decoder(DecoderConfig.from_hf(hf_model.config.to_dict()))
    with pytest.raises(ValueError, match=r"missing llama weights: \['layers.1.mlp.up_proj.weight'\]"):
        model.load_weights((name, w) for name, w in weights.items() if name != "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="'layers.0.self_attn.k_proj.weight' has shape"):
        model.load_weights({**weights, "model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}.items())
    with pytest.raises(ValueError, match="unexpected llama weight 'layers.0.mlp.extra.weight'"):
        model.load_weights({**weights, "model.layers.0.mlp.extra.weight": torch.zeros(1)}.items())


def test_bfloat16_checkpoint_runs_from_its_16_bit_rows_with_the_float32_bits(tmp_path: Path) -> None:
    """Every Linear of a bf16 checkpoint loaded in float32 keeps its bf16 rows (half the bytes); the
    engine's tokens and logprobs are the bits of the same weights expanded to float32 at load."""
    model_dir = tmp_path / "bf16"
    _hf_model("bfloat16_checkpoint", **CASES["bfloat16_checkpoint"]).bfloat16().save_pretrained(model_dir)
    runs = {}
    for gguf_weights in ("blocks", "dequantized"):
        llm = LLM(str(model_dir), num_blocks=96, block_size=BLOCK_SIZE, device="cpu", dtype="float32", gguf_weights=gguf_weights)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, (nn.Linear, GGUFBlockLinear))]
        assert all(isinstance(m, GGUFBlockLinear) == (gguf_weights == "blocks") for m in linears) and len(linears) == 9
        assert isinstance(llm.engine.runner.model.embed_tokens, GGUFBlockEmbedding) == (gguf_weights == "blocks")
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        runs[gguf_weights] = [(o.token_ids, o.logprobs) for o in llm.generate(_prompts(), params)]
    assert runs["blocks"] == runs["dequantized"]
