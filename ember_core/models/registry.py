"""Which model serves which HF `model_type`: GPT-2, or the one decoder of the Llama-like families."""

from __future__ import annotations

from typing import Any

from torch import nn

from ember_core.models.decoder import Decoder
from ember_core.models.decoder_config import DecoderConfig
from ember_core.models.family import FAMILIES
from ember_core.models.gpt2 import GPT2
from ember_core.models.gpt2_config import GPT2Config
from ember_core.parallel.gpt2_shards import GPT2Shards
from ember_core.parallel.group import TensorParallel
from ember_core.parallel.shards import DecoderShards

# Multimodal checkpoints whose language model ember serves (text in, text out): config.json's
# text_config describes it, and its weights are the checkpoint's model.language_model.*.
LANGUAGE_MODEL_OF = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED_MODEL_TYPES = sorted(["gpt2", *FAMILIES, *LANGUAGE_MODEL_OF])

# config.json's sizes, in either architecture's spelling: each must be a positive integer.
SIZE_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "n_ctx",
    "sliding_window", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "decoder_sparse_step", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval", "shared_intermediate_size",
    "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
)  # fmt: skip
# Sizes whose 0 means none, and in which model types (None: all): Qwen2-MoE's configs write
# sliding_window 0 for no window, Granite 4.0-H's dense ones num_local_experts 0.
ZERO_MEANS_NONE: dict[str, tuple[str, ...] | None] = {"sliding_window": None, "num_local_experts": ("granitemoehybrid",)}


def config_from_hf(hf_config: dict[str, Any]) -> DecoderConfig | GPT2Config:
    """The model's config from config.json, its sizes checked; ValueError for what ember does not serve."""
    if hf_config.get("model_type") in LANGUAGE_MODEL_OF:
        hf_config = _language_model_config(hf_config)
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; ember supports {SUPPORTED_MODEL_TYPES}")
    for key in SIZE_KEYS:
        value = hf_config.get(key)
        if value == 0 and _zero_means_none(key, model_type):
            continue
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    try:
        if model_type == "gpt2":
            return GPT2Config.from_hf(hf_config)
        return DecoderConfig.from_hf(hf_config)
    except KeyError as exc:
        raise ValueError(f"config.json has no {exc.args[0]!r}, which a {model_type} model needs") from None
    except TypeError as exc:
        raise ValueError(f"config.json holds a value of the wrong type: {exc}") from None


def _zero_means_none(key: str, model_type: str) -> bool:
    model_types = ZERO_MEANS_NONE.get(key, ())
    return model_types is None or model_type in model_types


def _language_model_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    model_type = hf_config["model_type"]
    text_config = hf_config.get("text_config")
    if not isinstance(text_config, dict):
        raise ValueError(f"config.json of a {model_type} model needs a text_config object")  # noqa: TRY004 - bad file content
    tied = hf_config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False))
    return {**text_config, "model_type": LANGUAGE_MODEL_OF[model_type], "tie_word_embeddings": tied}


def model_for(config: DecoderConfig | GPT2Config, parallel: TensorParallel | None = None) -> nn.Module:
    """The model of a config; with parallel, one tensor-parallel rank's part of it."""
    if isinstance(config, GPT2Config):
        return GPT2(config, parallel)
    return Decoder(config, parallel)


def shards_for(config: DecoderConfig | GPT2Config, parallel: TensorParallel) -> DecoderShards | GPT2Shards:
    """What a tensor-parallel rank takes of each of the model's checkpoint tensors."""
    return GPT2Shards(config, parallel) if isinstance(config, GPT2Config) else DecoderShards(config, parallel)


def model_from_hf_config(hf_config: dict[str, Any]) -> nn.Module:
    return model_for(config_from_hf(hf_config))
