"""The GGUF exporter against llama.cpp's conventions: tiny random checkpoints of every family,
exported and read back with gguf's reader. The expected names, keys and transformations are
written out here from llama.cpp's convert_hf_to_gguf.py, not taken from the exporter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

from ember_bench.gguf_export import export_gguf
from ember_bench.random_models import random_checkpoint

LLAMA_BLOCK = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"}
GEMMA2_BLOCK = LLAMA_BLOCK | {"post_attention_norm", "post_ffw_norm"}
QK_NORMS = {"attn_q_norm", "attn_k_norm"}
OLMO2_BLOCK = (LLAMA_BLOCK - {"attn_norm", "ffn_norm"}) | QK_NORMS | {"post_attention_norm", "post_ffw_norm"}
GPT2_BLOCK = {"attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"}

# family -> (general.architecture, per-block weights, per-block biases, top-level tensors, tokenizer model, pre)
EXPECTED = {
    "llama": ("llama", LLAMA_BLOCK, set(), {"token_embd", "output_norm", "output"}, "gpt2", "llama-bpe"),
    "mistral": ("llama", LLAMA_BLOCK, set(), {"token_embd", "output_norm", "output"}, "llama", "default"),
    "qwen2": ("qwen2", LLAMA_BLOCK, {"attn_q", "attn_k", "attn_v"}, {"token_embd", "output_norm"}, "gpt2", "qwen2"),
    "qwen3": ("qwen3", LLAMA_BLOCK | QK_NORMS, set(), {"token_embd", "output_norm"}, "gpt2", "qwen2"),
    "gemma2": ("gemma2", GEMMA2_BLOCK, set(), {"token_embd", "output_norm"}, "llama", "default"),
    "gemma3": ("gemma3", GEMMA2_BLOCK | QK_NORMS, set(), {"token_embd", "output_norm"}, "llama", "default"),
    "phi3": ("phi3", {"attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"}, set(),
             {"token_embd", "output_norm", "output"}, "llama", "default"),
    "olmo2": ("olmo2", OLMO2_BLOCK, set(), {"token_embd", "output_norm", "output"}, "gpt2", "gpt-2"),
    "gpt2": ("gpt2", GPT2_BLOCK, GPT2_BLOCK, {"token_embd", "position_embd", "output_norm"}, "gpt2", "gpt-2"),
}
# the HF tensor each GGUF block tensor comes from (suffix after model.layers.N.)
HF_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_qkv": "self_attn.qkv_proj", "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
HF_NAMES_BY_FAMILY = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm"},
    "olmo2": {"post_attention_norm": "post_attention_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
GPT2_HF_NAMES = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                 "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    made: dict[tuple[str, tuple], Path] = {}

    def make(family: str, **overrides) -> Path:
        key = (family, tuple(sorted((k, json.dumps(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = random_checkpoint(family, tmp_path_factory.mktemp(family), seed=3, **overrides)
        return made[key]

    return make


def read(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return fields, {tensor.name: tensor for tensor in reader.tensors}


def dequantized(tensor) -> np.ndarray:
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))


def hf_weights(model_dir: Path) -> dict[str, np.ndarray]:
    return {name: value.float().numpy() for name, value in load_file(model_dir / "model.safetensors").items()}


def unpermute_llama_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """GGUF llama q/k rows per head are pairs (x0, y0, x1, y1, ...); HF's are halves (x0, x1, ..., y0, y1, ...)."""
    rows_per_head = weight.shape[0] // num_heads
    return weight.reshape(num_heads, rows_per_head // 2, 2, -1).transpose(0, 2, 1, 3).reshape(weight.shape)


def expected_gguf_value(family: str, gguf_name: str, hf: dict[str, np.ndarray], config: dict):
    """(the HF tensor as the GGUF should hold it, undone to compare) for one GGUF tensor."""
    parts = gguf_name.split(".")
    suffix = parts[-1]
    if family == "gpt2":
        top = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f"}
        stem = f"transformer.h.{parts[1]}.{GPT2_HF_NAMES[parts[2]]}" if parts[0] == "blk" else top[parts[0]]
        hf_name = f"{stem}.{suffix}"
        value = hf[hf_name]
        return value.T if parts[0] == "blk" and suffix == "weight" and value.ndim == 2 else value
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    if parts[0] == "blk":
        names = {**HF_NAMES, **HF_NAMES_BY_FAMILY.get(family, {})}
        hf_name = f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    else:
        hf_name = f"{top[parts[0]]}.{suffix}"
    value = hf[hf_name]
    if family in ("llama", "mistral") and parts[-2] in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if parts[-2] == "attn_q" else config["num_key_value_heads"]
        return ("unpermute", value, heads)
    if family in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
        return value + 1.0
    return value


@pytest.mark.parametrize("family", list(EXPECTED))
def test_f32_export_has_llama_cpp_names_keys_and_the_checkpoint_weights(family: str, checkpoints, tmp_path: Path):
    model_dir = checkpoints(family)
    config = json.loads((model_dir / "config.json").read_text())
    fields, tensors = read(export_gguf(model_dir, tmp_path / "model.gguf", "F32"))
    arch, block, biases, top, tokenizer_model, pre = EXPECTED[family]
    layers = config.get("num_hidden_layers") or config["n_layer"]

    assert fields["general.architecture"] == arch
    assert fields["general.file_type"] == gguf.LlamaFileType.ALL_F32
    expected_names = {f"{name}.weight" for name in top}
    expected_names |= {f"{name}.bias" for name in top if family == "gpt2" and name == "output_norm"}
    for layer in range(layers):
        expected_names |= {f"blk.{layer}.{name}.weight" for name in block}
        expected_names |= {f"blk.{layer}.{name}.bias" for name in biases}
    assert set(tensors) == expected_names

    hf = hf_weights(model_dir)
    for name, tensor in tensors.items():
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        expected = expected_gguf_value(family, name, hf, config)
        stored = dequantized(tensor)
        if isinstance(expected, tuple):
            _, expected, heads = expected
            stored = unpermute_llama_rope(stored, heads)
        np.testing.assert_array_equal(stored, expected, err_msg=name)

    assert fields[f"{arch}.block_count"] == layers
    assert fields[f"{arch}.embedding_length"] == (config.get("hidden_size") or config["n_embd"])
    assert fields["tokenizer.ggml.model"] == tokenizer_model
    assert fields["tokenizer.ggml.pre"] == pre
    assert len(fields["tokenizer.ggml.tokens"]) == config["vocab_size"]
    assert fields["tokenizer.ggml.eos_token_id"] == config["eos_token_id"]
    if config.get("bos_token_id") is not None:
        assert fields["tokenizer.ggml.bos_token_id"] == config["bos_token_id"]
    assert "<|im_start|>" in fields["tokenizer.chat_template"]


def test_decoder_hyperparameters_are_llama_cpp_keys(checkpoints, tmp_path: Path):
    fields, _ = read(export_gguf(checkpoints("qwen3"), tmp_path / "qwen3.gguf"))
    assert fields["qwen3.context_length"] == 256
    assert fields["qwen3.feed_forward_length"] == 128
    assert fields["qwen3.attention.head_count"] == 4
    assert fields["qwen3.attention.head_count_kv"] == 2
    assert fields["qwen3.attention.key_length"] == fields["qwen3.attention.value_length"] == 16
    assert fields["qwen3.rope.freq_base"] == 10000.0
    assert math.isclose(fields["qwen3.attention.layer_norm_rms_epsilon"], 1e-6, rel_tol=1e-6)

    fields, _ = read(export_gguf(checkpoints("mistral"), tmp_path / "mistral.gguf"))
    assert fields["llama.vocab_size"] == 512
    assert fields["llama.rope.dimension_count"] == 16


def test_gemma_keys_softcaps_and_sliding_window_pattern(checkpoints, tmp_path: Path):
    fields, _ = read(export_gguf(checkpoints("gemma2"), tmp_path / "gemma2.gguf"))
    assert fields["gemma2.attn_logit_softcapping"] == 50.0
    assert fields["gemma2.final_logit_softcapping"] == 30.0
    assert fields["gemma2.attention.sliding_window"] == 16
    assert "gemma2.attention.sliding_window_pattern" not in fields  # llama.cpp's every-other-layer default holds

    fields, _ = read(export_gguf(checkpoints("gemma3"), tmp_path / "gemma3.gguf"))
    assert fields["gemma3.attention.sliding_window"] == 16
    assert fields["gemma3.rope.freq_base"] == 1_000_000.0
    assert fields["gemma3.rope.freq_base_swa"] == 10_000.0
    assert "gemma3.final_logit_softcapping" not in fields
    assert "gemma3.attention.sliding_window_pattern" not in fields  # layer 5 global: llama.cpp's default

    layer_types = ["sliding_attention", "full_attention", "full_attention"]
    fields, _ = read(export_gguf(
        checkpoints("gemma3", num_hidden_layers=3, layer_types=layer_types), tmp_path / "gemma3-pattern.gguf"
    ))
    assert fields["gemma3.attention.sliding_window_pattern"] == [True, False, False]

    fields, _ = read(export_gguf(
        checkpoints("gemma3", layer_types=["full_attention"] * 6), tmp_path / "gemma3-global.gguf"
    ))
    assert "gemma3.attention.sliding_window" not in fields  # llama.cpp then runs every layer global


def test_llama3_rope_scaling_becomes_rope_freqs_that_reproduce_transformers(checkpoints, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = checkpoints("llama", rope_parameters=rope)
    fields, tensors = read(export_gguf(model_dir, tmp_path / "llama3.gguf"))
    divisors = dequantized(tensors["rope_freqs.weight"])
    assert "llama.rope.scaling.type" not in fields
    base_inv_freq = 1.0 / (500000.0 ** (np.arange(0, 16, 2) / 16))
    scaled = AutoModelForCausalLM.from_pretrained(model_dir).model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(base_inv_freq / divisors, scaled, rtol=1e-5)
    assert not np.allclose(divisors, 1.0)


def test_phi3_longrope_writes_factor_tensors_and_the_attention_factor(checkpoints, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0 + i / 4 for i in range(8)],
            "short_factor": [1.0 + i / 16 for i in range(8)], "original_max_position_embeddings": 64}
    model_dir = checkpoints("phi3", rope_parameters=rope, original_max_position_embeddings=64)
    fields, tensors = read(export_gguf(model_dir, tmp_path / "phi3.gguf", "Q8_0"))
    np.testing.assert_array_equal(dequantized(tensors["rope_factors_long.weight"]), rope["long_factor"])
    np.testing.assert_array_equal(dequantized(tensors["rope_factors_short.weight"]), rope["short_factor"])
    assert tensors["rope_factors_long.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert fields["phi3.rope.scaling.original_context_length"] == 64
    assert fields["phi3.rope.dimension_count"] == 16
    scaling = AutoModelForCausalLM.from_pretrained(model_dir).model.rotary_emb.attention_scaling
    assert math.isclose(fields["phi3.rope.scaling.attn_factor"], scaling, rel_tol=1e-6)


@pytest.mark.parametrize(("file_type", "qtype", "step"), [
    ("Q8_0", gguf.GGMLQuantizationType.Q8_0, 1 / 127),
    ("Q4_0", gguf.GGMLQuantizationType.Q4_0, 1 / 8),
    ("Q5_1", gguf.GGMLQuantizationType.Q5_1, 2 / 31),  # step (max - min) / 31, and max - min <= 2 amax
])
def test_quantized_export_keeps_norms_f32_and_falls_back_to_f16_for_odd_rows(
    file_type: str, qtype: gguf.GGMLQuantizationType, step: float, checkpoints, tmp_path: Path
):
    model_dir = checkpoints("qwen2", intermediate_size=80)  # ffn_down rows of 80 values: not whole blocks of 32
    config = json.loads((model_dir / "config.json").read_text())
    fields, tensors = read(export_gguf(model_dir, tmp_path / f"{file_type}.gguf", file_type))
    assert fields["general.file_type"] == getattr(gguf.LlamaFileType, f"MOSTLY_{file_type}")
    hf = hf_weights(model_dir)
    for name, tensor in tensors.items():
        expected = expected_gguf_value("qwen2", name, hf, config)
        if name.endswith(("_norm.weight", ".bias")):
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, name
            np.testing.assert_array_equal(dequantized(tensor), expected)
        elif name.endswith("ffn_down.weight"):
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F16, name
            np.testing.assert_allclose(dequantized(tensor), expected, rtol=1e-3, atol=1e-3)
        else:
            assert tensor.tensor_type == qtype, name
            blocks = np.abs(expected).reshape(expected.shape[0], -1, 32).max(axis=-1, keepdims=True)
            error = np.abs(dequantized(tensor) - expected).reshape(blocks.shape[0], -1, 32)
            assert (error <= blocks * step + 1e-6).all(), name


def test_sentencepiece_scores_rank_merges_and_bytes_are_byte_tokens(checkpoints, tmp_path: Path):
    model_dir = checkpoints("mistral")
    fields, _ = read(export_gguf(model_dir, tmp_path / "m.gguf"))
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    tokens, scores = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
    types = fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.add_space_prefix"] is True
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert types[tokens.index("<0x41>")] == gguf.TokenType.BYTE
    assert types[tokens.index("<unk>")] == gguf.TokenType.UNKNOWN
    assert types[tokens.index("<s>")] == gguf.TokenType.CONTROL
    first, later = spec["model"]["merges"][0], spec["model"]["merges"][-1]
    assert scores[tokens.index("".join(first))] > scores[tokens.index("".join(later))]

    fields, _ = read(export_gguf(checkpoints("gemma2"), tmp_path / "g.gguf"))
    assert fields["tokenizer.ggml.add_space_prefix"] is False


def test_bad_input_is_a_clear_value_error(checkpoints, tmp_path: Path):
    with pytest.raises(ValueError, match="unsupported GGUF file type 'Q3_K'"):
        export_gguf(checkpoints("qwen2"), tmp_path / "x.gguf", "Q3_K")
    config_dir = tmp_path / "bert"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="cannot export architecture 'BertModel'"):
        export_gguf(config_dir, tmp_path / "y.gguf")


def test_make_model_cli_writes_checkpoint_and_gguf(tmp_path: Path):
    from tests.bench.helpers import run_bench_cli

    out = tmp_path / "olmo2"
    assert run_bench_cli("make-model", "--family", "olmo2", "--out", str(out), "--gguf", "BF16", "Q8_0",
                         "--set", "num_hidden_layers=1") == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    fields, tensors = read(out / "model-Q8_0.gguf")
    assert fields["olmo2.block_count"] == 1
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    bf16 = read(out / "model-BF16.gguf")[1]["blk.0.attn_q.weight"]
    assert bf16.tensor_type == gguf.GGMLQuantizationType.BF16
    reference = hf_weights(out)["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_allclose(dequantized(bf16), reference, rtol=2 ** -8)
