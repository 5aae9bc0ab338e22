"""Small random checkpoints of every model family ember serves, built with transformers' own class of
the family (the reference), with each family's distinctive switches turned on: biases, q/k norms,
sliding windows shorter than the test prompts, soft-caps, partial rotary, per-layer-type RoPE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from ember_bench.families import FAMILIES as ALL_FAMILIES
from ember_bench.families import TEST_WINDOW, Family

VOCAB = 311
# Every family's: a hidden size and head count that give GQA, several layers, windows of 7 positions.
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip
WINDOW = TEST_WINDOW
# The decoder families (GPT-2, ember's other model, has tests/conftest.py's checkpoint; the hybrids
# have tests/core/models/test_hybrid.py), each with its switches from ember_bench.families' one
# table, which the bench's random checkpoints read too.
FAMILIES: dict[str, Family] = {name: family for name, family in ALL_FAMILIES.items() if family.decoder and not family.hybrid}


# What a GGUF file cannot say, so llama.cpp reads these otherwise: a window in the llama
# architecture (Mistral, Mixtral), Qwen 2's and Qwen3-MoE's sliding layers, a Gemma query scale other than head_dim^-1/2.
GGUF_OVERRIDES = {
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False),
    "gemma2": dict(query_pre_attn_scalar=16),
    "mixtral": dict(sliding_window=None),
    "qwen3_moe": dict(use_sliding_window=False),
}


def hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    row = FAMILIES[family]
    config = getattr(transformers, row.config_class)(**{**COMMON, **row.test_switches, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, row.model_class)(config).eval()
    with torch.no_grad():
        # Larger than the default init, and norm weights away from their default, so every weight shows.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if row.zero_centered_norms else param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    return model


def write_checkpoint(family: str, path: Path, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    model = hf_model(family, seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    return model


def token_prompts(lengths: tuple[int, ...], seed: int = 1234) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


# Qwen3.5's hybrid decoder, apart from the family table (tests/core/models/test_hybrid.py): a layer
# pattern and shapes apart from Qwen3.5's own (one full-attention layer in four): value heads twice
# the key heads, key and value heads of different widths, a convolution of 3.
HYBRID = dict(
    COMMON, num_hidden_layers=5, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
)  # fmt: skip


# Granite 4.0-H's: Mamba2 layers in the legacy spelling of layer_types real configs use, 8 heads in 2
# groups of B and C, a state of 12, a convolution of 3 with a bias, attention without RoPE, Granite's
# multipliers; a dense shared MLP (Micro) or one beside 2 of 6 experts (Tiny).
GRANITE_HYBRID = dict(
    COMMON, num_hidden_layers=5, layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
    mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=12, mamba_d_conv=3, num_local_experts=0,
    shared_intermediate_size=48, embedding_multiplier=12.0, attention_multiplier=0.0625,
    residual_multiplier=0.22, logits_scaling=4.0,
)  # fmt: skip


# Per hybrid family: transformers' config and model classes and the test checkpoint's config.
# Qwen3.5-MoE: every layer's MLP routes to 2 of 6 experts beside a gated shared expert. LFM2: short
# convolutions of 4 with biases, an MLP width its config class rounds to a multiple of 32.
HYBRID_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HYBRID),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        HYBRID, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    )),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        {key: value for key, value in COMMON.items() if key != "rms_norm_eps"}, norm_eps=1e-5, num_hidden_layers=5,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"], conv_L_cache=4, conv_bias=True,
        block_multiple_of=32,
    )),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE_HYBRID),
    "granitemoehybrid_moe": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        GRANITE_HYBRID, num_local_experts=6, num_experts_per_tok=2, intermediate_size=32,
    )),
}  # fmt: skip


def write_hybrid_checkpoint(path: Path, seed: int = 0, family: str = "qwen3_5", **overrides: Any) -> transformers.PreTrainedModel:
    config_class, model_class, config = HYBRID_FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**config, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("linear_attn.norm.weight", "mamba.norm.weight")):  # the mixers' gated norms scale by w
                param.uniform_(0.5, 1.5)
            elif "norm" in name:
                param.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                param.uniform_(-1.0, 1.0)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    if config_class == "GraniteMoeHybridConfig":  # as IBM's configs spell layer_types (transformers 4's names)
        config_file = path / "config.json"
        saved = json.loads(config_file.read_text())
        saved["layer_types"] = [LEGACY_LAYER_TYPES[kind] for kind in saved["layer_types"]]
        config_file.write_text(json.dumps(saved, indent=2))
    return model


LEGACY_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}


def transformers_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """generate()'s greedy tokens: the prompt in one forward, then one token at a time over its cache."""
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation)[0, len(prompt) :].tolist()
