"""Random-weight checkpoints of every family, built with the family's own transformers class and
saved as a Hugging Face model directory (safetensors, config, tokenizer, chat template).

Weights are drawn so that every one matters and greedy decoding neither ties nor echoes its
input: matrices ~ N(0, 1/fan_in), an untied output head N(0, 1), embeddings N(0, 4/hidden) (Gemma's,
which the model multiplies by sqrt(hidden), N(0, 4/hidden^2)), biases ~ N(0, 0.01), norm weights
uniform within 0.5 of their identity value.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ember_bench.families import FAMILIES
from ember_bench.random_tokenizers import write_tokenizer

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
    # Qwen3.5-0.8B's text model: 24 layers, every fourth full attention (8 heads of 256, 2 KV heads,
    # a quarter of each rotated), the others Gated DeltaNets (16 q/k and 16 value heads of 128).
    "qwen3.5-0.8b": ("qwen3_5", {
        "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": True,
    }),
}


def random_checkpoint(
    family: str, out_dir: Path, *, preset: str | None = None, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a random checkpoint of family to out_dir and return out_dir. The tiny default shape
    (or the preset's) is updated with config_overrides, e.g. num_hidden_layers=3, sliding_window=8."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
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
