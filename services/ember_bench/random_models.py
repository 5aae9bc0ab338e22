"""Random-weight checkpoints of every family, built with the family's own transformers class and
saved as a Hugging Face model directory (safetensors, config, tokenizer, chat template).

Weights are drawn so that every one matters and greedy decoding neither ties nor echoes its
input: matrices ~ N(0, 1/fan_in), an untied output head N(0, 1), embeddings N(0, 4/hidden) (Gemma's,
which the model multiplies by sqrt(hidden), N(0, 4/hidden^2)), biases ~ N(0, 0.01), norm weights
uniform within 0.5 of their identity value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ember_bench.random_tokenizers import CHAT_TOKENS, SpecialTokens, TokenizerStyle, write_tokenizer

_TINY_DECODER: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
}
_TINY_WITH_HEAD_DIM = {**_TINY_DECODER, "head_dim": 16}  # configs whose head_dim default is not hidden / heads
_TINY_GEMMA = {**_TINY_WITH_HEAD_DIM, "query_pre_attn_scalar": 16, "sliding_window": 16}  # llama.cpp scales by head_dim
# 8 experts of 64 (the expert size where config.json names it intermediate_size), top-2.
_TINY_MOE = {**_TINY_DECODER, "intermediate_size": 64, "num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2}
_SPM_SPECIALS = SpecialTokens(bos="<s>", eos="</s>", unk="<unk>", add_bos=True)
_GEMMA_SPECIALS = SpecialTokens(bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>", add_bos=True)
_QWEN_SPECIALS = SpecialTokens(bos=None, eos="<|im_end|>", pad="<|endoftext|>")


@dataclass(frozen=True)
class RandomFamily:
    model_class: str  # in transformers
    config_class: str
    tokenizer: TokenizerStyle
    specials: SpecialTokens
    tiny: dict[str, Any] = field(default_factory=lambda: dict(_TINY_DECODER))
    zero_centered_norms: bool = False  # Gemma's RMSNorm scales by (1 + w)
    embeddings_times_sqrt_hidden: bool = False  # Gemma scales its input embeddings up


RANDOM_FAMILIES: dict[str, RandomFamily] = {
    "llama": RandomFamily("LlamaForCausalLM", "LlamaConfig", "llama3",
                          SpecialTokens(bos="<|begin_of_text|>", eos="<|end_of_text|>", add_bos=True)),
    "mistral": RandomFamily("MistralForCausalLM", "MistralConfig", "sentencepiece", _SPM_SPECIALS),
    "qwen2": RandomFamily("Qwen2ForCausalLM", "Qwen2Config", "qwen2", _QWEN_SPECIALS,
                          {**_TINY_DECODER, "tie_word_embeddings": True}),
    "qwen3": RandomFamily("Qwen3ForCausalLM", "Qwen3Config", "qwen2", _QWEN_SPECIALS,
                          {**_TINY_WITH_HEAD_DIM, "tie_word_embeddings": True}),
    "gemma2": RandomFamily("Gemma2ForCausalLM", "Gemma2Config", "sentencepiece_no_prefix", _GEMMA_SPECIALS,
                           dict(_TINY_GEMMA), zero_centered_norms=True, embeddings_times_sqrt_hidden=True),
    "gemma3": RandomFamily("Gemma3ForCausalLM", "Gemma3TextConfig", "sentencepiece_no_prefix", _GEMMA_SPECIALS,
                           {**_TINY_GEMMA, "num_hidden_layers": 6},  # layer 5 is global
                           zero_centered_norms=True, embeddings_times_sqrt_hidden=True),
    "phi3": RandomFamily("Phi3ForCausalLM", "Phi3Config", "sentencepiece",
                         SpecialTokens(bos="<s>", eos="<|endoftext|>", unk="<unk>", add_bos=True, others=("</s>",),
                                       rstrip=("</s>", *CHAT_TOKENS)),  # as Phi-3's, which llama.cpp expects
                         {**_TINY_DECODER, "original_max_position_embeddings": 256}),
    "olmo2": RandomFamily("Olmo2ForCausalLM", "Olmo2Config", "gpt2",
                          SpecialTokens(bos=None, eos="<|endoftext|>", pad="<|pad|>")),
    "mixtral": RandomFamily("MixtralForCausalLM", "MixtralConfig", "sentencepiece", _SPM_SPECIALS, dict(_TINY_MOE)),
    "qwen2_moe": RandomFamily("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "qwen2", _QWEN_SPECIALS,
                              {**_TINY_MOE, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128}),
    "qwen3_moe": RandomFamily("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "qwen2", _QWEN_SPECIALS,
                              {**_TINY_MOE, "head_dim": 16, "moe_intermediate_size": 64, "norm_topk_prob": True}),
    # As OLMoE's own: as many KV heads as query heads (llama.cpp sizes the k norm by the hidden size).
    "olmoe": RandomFamily("OlmoeForCausalLM", "OlmoeConfig", "gpt2",
                          SpecialTokens(bos=None, eos="<|endoftext|>", pad="<|pad|>"),
                          {**_TINY_MOE, "num_key_value_heads": 4}),
    "gpt2": RandomFamily("GPT2LMHeadModel", "GPT2Config", "gpt2",
                         SpecialTokens(bos="<|endoftext|>", eos="<|endoftext|>"),
                         {"vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
}

_BENCH_QWEN3 = {
    "vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
}
# name -> (family, config values): the shapes the benchmarks run
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2", {
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
    }),
    # A Qwen3-MoE shape small enough for 2 cores (8 layers, 32 experts of 512, top-4: 0.46B parameters,
    # 0.10B active), and the dense model of its active size: the same layers and attention with one
    # MLP of 4 x 512.
    "qwen3-moe-bench": ("qwen3_moe", {**_BENCH_QWEN3, "num_experts": 32, "num_experts_per_tok": 4,
                                       "moe_intermediate_size": 512, "norm_topk_prob": True}),
    "qwen3-dense-bench": ("qwen3", {**_BENCH_QWEN3, "intermediate_size": 2048}),
}


def random_checkpoint(
    family: str, out_dir: Path, *, preset: str | None = None, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a random checkpoint of family to out_dir and return out_dir. The tiny default shape
    (or the preset's) is updated with config_overrides, e.g. num_hidden_layers=3, sliding_window=8."""
    if family not in RANDOM_FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(RANDOM_FAMILIES)}")
    spec = RANDOM_FAMILIES[family]
    values = dict(spec.tiny)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        preset_family, preset_values = PRESETS[preset]
        if preset_family != family:
            raise ValueError(f"preset {preset!r} is a {preset_family} model, not {family}")
        values = dict(preset_values)
    values.update(config_overrides)

    import transformers
    from tokenizers import Tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir, spec.tokenizer, spec.specials, values["vocab_size"], seed=seed)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    for role in ("bos", "eos", "pad"):
        text = getattr(spec.specials, role)
        values[f"{role}_token_id"] = None if text is None else tokenizer.token_to_id(text)
    config = getattr(transformers, spec.config_class)(**values)
    model = getattr(transformers, spec.model_class)(config)
    hidden = values.get("hidden_size") or values["n_embd"]
    # Small enough that each layer's output outweighs the input token's own embedding, which
    # would otherwise win every step through tied output weights: the model would echo its input.
    embedding_std = (2.0 / hidden) if spec.embeddings_times_sqrt_hidden else (2.0 / math.sqrt(hidden))
    randomize_weights(model, seed, spec.zero_centered_norms, embedding_std)
    model.eval().save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int, zero_centered_norms: bool, embedding_std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            if any(part in name for part in ("embed", "wte", "wpe")):
                std = embedding_std
            elif "lm_head" in name:
                std = 1.0
            else:
                std = 1.0 / math.sqrt(param.shape[-1])
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        elif "norm" in name or ".ln_" in name:
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            else:
                center = 0.0 if zero_centered_norms else 1.0
                param.copy_(center + torch.rand(param.shape, generator=generator) - 0.5)
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
