"""Small random checkpoints of every model family ember serves, built with transformers' own class of
the family (the reference), with each family's distinctive switches turned on: biases, q/k norms,
sliding windows shorter than the test prompts, soft-caps, partial rotary, per-layer-type RoPE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 311
# Every family's: a hidden size and head count that give GQA, several layers, windows of 7 positions.
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip
WINDOW = 7
FAMILIES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2": (
        transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
        # sliding layers from the third on, as Qwen2's max_window_layers makes them
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, tie_word_embeddings=True),
    ),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24, attention_bias=True)),
    "gemma2": (
        transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
        dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=WINDOW, attn_logit_softcapping=3.0,
             final_logit_softcapping=5.0),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            },
        ),
    ),
    "phi3": (
        transformers.Phi3Config, transformers.Phi3ForCausalLM,
        # LongRoPE whose long table turns from position 64 on, over 3/4 of each head
        dict(
            max_position_embeddings=512, original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + 0.5 * i for i in range(6)],
            },
        ),
    ),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    # The mixtures of experts: 6-8 experts, top-2, with and without renormalised weights; Qwen2-MoE's
    # shared expert and a dense layer (mlp_only_layers), Qwen3-MoE's dense layers between sparse ones
    # (and its window, which every layer takes).
    "mixtral": (
        transformers.MixtralConfig, transformers.MixtralForCausalLM,
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, sliding_window=WINDOW),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
             mlp_only_layers=[2], norm_topk_prob=False),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2, head_dim=24,
             norm_topk_prob=True, use_sliding_window=True, sliding_window=WINDOW),
    ),
    "olmoe": (
        transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64, norm_topk_prob=False),
    ),
}  # fmt: skip


def hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    config_class, model_class, family_overrides = FAMILIES[family]
    config = config_class(**{**COMMON, **family_overrides, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        # Larger than the default init, and norm weights away from their default, so every weight shows.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if family.startswith("gemma") else param.uniform_(0.5, 1.5)
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
