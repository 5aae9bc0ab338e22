"""A DecoderConfig from a GGUF file's metadata, read as llama.cpp reads each `general.architecture`."""

from __future__ import annotations

from typing import Any

import gguf

from ember_core.loaders.gguf_tensors import ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ROPE_FREQS, dequantize
from ember_core.models.decoder_config import (
    ACTIVATIONS,
    DecoderConfig,
    LayerSpec,
    LinearAttentionConfig,
    Mamba2Config,
    MoEConfig,
    ShortConvConfig,
)
from ember_core.models.family import FAMILIES, GGUF_ARCHITECTURES, Family
from ember_core.models.rotary import Rope, RopeScaling
from ember_core.pooling import GGUF_POOLING_TYPES

_REQUIRED = object()
# What llama.cpp fixes per architecture where the file says nothing: which layers slide (every
# n-th attends globally, unless attention.sliding_window_pattern says), the sliding layers' RoPE
# base, the activation.
_WINDOW_PATTERNS = {"gemma2": 2, "gemma3": 6}
_LOCAL_ROPE_BASE = {"gemma3": 10_000.0}
_GELU_ARCHITECTURES = ("gemma2", "gemma3")
# Where llama.cpp renormalises the top-k expert weights when the file has no expert_weights_norm.
_NORMALIZED_TOP_K = ("llama", "qwen3moe", "qwen35moe", "granitehybrid")
# Granite's dense MLP is its shared expert: the width's key where it is not feed_forward_length.
_DENSE_MLP_KEYS = {"granitehybrid": "expert_shared_feed_forward_length"}
# llama.cpp's Granite architectures take rope.scaling.finetuned as the switch of RoPE (on unless it says).
_ROPE_SWITCHED = ("granitehybrid",)
# llama.cpp scales Gemma's 27B queries by (hidden / heads)^-1/2, the others by head_dim^-1/2; it tells
# them by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def metadata(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """A scalar or string metadata value."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file has no {key!r} metadata")
        return default
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key!r} is an array; ember expects one value")
    part = field.parts[field.data[0]]
    return part.tobytes().decode("utf-8") if field.types[0] == gguf.GGUFValueType.STRING else part[0].item()


def gguf_family(reader: gguf.GGUFReader) -> tuple[str, Family]:
    architecture = metadata(reader, "general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported; ember loads {sorted(GGUF_ARCHITECTURES)} GGUF files"
        )
    if architecture == "llama" and metadata(reader, "llama.expert_count", 0):
        return architecture, FAMILIES["mixtral"]
    return architecture, GGUF_ARCHITECTURES[architecture]


def decoder_config_from_gguf(reader: gguf.GGUFReader) -> DecoderConfig:
    architecture, family = gguf_family(reader)

    def value(key: str, default: Any = _REQUIRED) -> Any:
        return metadata(reader, f"{architecture}.{key}", default)

    def multiplier(key: str) -> float | None:
        """One of Granite's scales: none where the file has none or 0, as llama.cpp reads them."""
        return (value(key, None) or None) if family.multipliers else None

    tensors = {tensor.name: tensor for tensor in reader.tensors}
    # block_count counts a multi-token-prediction block after the model's layers (Qwen3.5's files).
    hidden, num_layers = value("embedding_length"), value("block_count") - value("nextn_predict_layers", 0)
    num_heads = value("attention.head_count")
    head_dim = value("attention.key_length", hidden // num_heads)
    context_length = value("context_length")
    rotates = architecture not in _ROPE_SWITCHED or bool(value("rope.scaling.finetuned", True))
    rope = Rope(
        head_dim=head_dim,
        rotary_dim=value("rope.dimension_count", head_dim) if rotates else 0,
        theta=float(value("rope.freq_base", 10000.0)),
        scaling=_rope_scaling(reader, architecture, context_length, tensors),
        freq_factors=_factors(tensors.get(ROPE_FREQS)),
    )
    window = value("attention.sliding_window", None) or None  # Phi-3 files write 0 for none
    slides = _sliding_layers(reader, architecture, num_layers)
    moe = _moe_config(reader, architecture, family, tensors)
    sparse = [f"blk.{index}.ffn_gate_inp.weight" in tensors for index in range(num_layers)]
    kv_heads = _kv_heads(reader, architecture, num_heads, num_layers)
    linear_attention: LinearAttentionConfig | ShortConvConfig | Mamba2Config | None = None
    linear = [False] * num_layers
    if family.mixer in ("short_conv", "mamba2"):  # LFM2, Granite: the recurrent layers are those without KV heads
        linear = [heads == 0 for heads in kv_heads]
        linear_attention = _recurrent_config(reader, architecture, family, tensors)
    elif family.linear_attention:
        linear_attention = _linear_attention_config(reader, architecture)
        linear = _recurrent_layers(reader, architecture, num_layers)
    layers = tuple(
        LayerSpec(window if window and sliding else None, rope, sparse_mlp, linear_layer)
        for sliding, sparse_mlp, linear_layer in zip(slides, sparse, linear)
    )
    if architecture in _LOCAL_ROPE_BASE:
        local = Rope(rope.head_dim, rope.rotary_dim, float(value("rope.freq_base_swa", _LOCAL_ROPE_BASE[architecture])))
        layers = tuple(
            LayerSpec(layer.sliding_window, local if layer.sliding_window else rope, layer.sparse_mlp) for layer in layers
        )
    scale = value("attention.scale", None)
    if scale is None and value("block_count") == _GEMMA_27B_LAYERS.get(architecture):
        scale = (hidden // num_heads) ** -0.5
    return DecoderConfig(
        family=family,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # ggml's ne: [hidden, vocab]
        max_position_embeddings=context_length,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=max(kv_heads),
        head_dim=head_dim,
        intermediate_size=value(_DENSE_MLP_KEYS.get(architecture, "feed_forward_length")),
        layers=layers,
        rms_norm_eps=value("attention.layer_norm_rms_epsilon"),
        activation=ACTIVATIONS["gelu_pytorch_tanh" if architecture in _GELU_ARCHITECTURES else "silu"],
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        query_scale=scale,
        attn_logit_softcap=value("attn_logit_softcapping", None) if family.attn_logit_softcapping else None,
        final_logit_softcap=value("final_logit_softcapping", None) if family.final_logit_softcapping else None,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=metadata(reader, "tokenizer.ggml.eos_token_id", None),
        moe=moe,
        pooling=GGUF_POOLING_TYPES.get(value("pooling_type", 0)),
        linear_attention=linear_attention,
        embedding_multiplier=multiplier("embedding_scale"),
        residual_multiplier=multiplier("residual_scale"),
        logits_scaling=multiplier("logit_scale"),
    )


def _recurrent_config(
    reader: gguf.GGUFReader, architecture: str, family: Family, tensors: dict
) -> ShortConvConfig | Mamba2Config:
    """LFM2's short convolution or Granite's Mamba2, as llama.cpp's lfm2 and granitehybrid read them;
    biases where the file has them."""

    def has(suffix: str) -> bool:
        return any(name.startswith("blk.") and name.endswith(suffix) for name in tensors)

    if family.mixer == "short_conv":
        return ShortConvConfig(kernel=metadata(reader, f"{architecture}.shortconv.l_cache"), bias=has(".shortconv.conv.bias"))

    def value(key: str) -> Any:
        return metadata(reader, f"{architecture}.ssm.{key}")

    num_heads = value("time_step_rank")
    return Mamba2Config(
        num_heads=num_heads,
        head_dim=value("inner_size") // num_heads,
        state_size=value("state_size"),
        num_groups=value("group_count"),
        conv_kernel=value("conv_kernel"),
        conv_bias=has(".ssm_conv1d.bias"),
        projection_bias=has(".ssm_in.bias"),
    )


def _kv_heads(reader: gguf.GGUFReader, architecture: str, num_heads: int, num_layers: int) -> list[int]:
    """attention.head_count_kv per layer: one value, or (LFM2) a list with 0 for layers without attention."""
    field = reader.fields.get(f"{architecture}.attention.head_count_kv")
    if field is None:
        return [num_heads] * num_layers
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        heads = [int(count) for count in field.contents()]
        if len(heads) < num_layers:
            raise ValueError(f"attention.head_count_kv lists {len(heads)} layers, the model has {num_layers}")
        return heads[:num_layers]
    return [metadata(reader, f"{architecture}.attention.head_count_kv")] * num_layers


def _linear_attention_config(reader: gguf.GGUFReader, architecture: str) -> LinearAttentionConfig:
    """A Gated DeltaNet's sizes as llama.cpp's qwen35 reads them: ssm.group_count q/k heads of
    ssm.state_size, ssm.time_step_rank value heads sharing ssm.inner_size, value heads tiled."""

    def value(key: str) -> Any:
        return metadata(reader, f"{architecture}.ssm.{key}")

    num_value_heads = value("time_step_rank")
    return LinearAttentionConfig(
        num_key_heads=value("group_count"),
        num_value_heads=num_value_heads,
        key_head_dim=value("state_size"),
        value_head_dim=value("inner_size") // num_value_heads,
        conv_kernel=value("conv_kernel"),
        tiled_value_heads=True,
    )


def _recurrent_layers(reader: gguf.GGUFReader, architecture: str, num_layers: int) -> list[bool]:
    """attention.recurrent_layers' flag per layer, else all but every full_attention_interval-th."""
    field = reader.fields.get(f"{architecture}.attention.recurrent_layers")
    if field is not None:
        flags = [bool(flag) for flag in field.contents()]
        if len(flags) < num_layers:
            raise ValueError(f"attention.recurrent_layers lists {len(flags)} layers, the model has {num_layers}")
        return flags[:num_layers]
    interval = metadata(reader, f"{architecture}.full_attention_interval", 4)
    return [(index + 1) % interval != 0 for index in range(num_layers)]


def _moe_config(reader: gguf.GGUFReader, architecture: str, family: Family, tensors: dict) -> MoEConfig | None:
    def value(key: str, default: Any = _REQUIRED) -> Any:
        return metadata(reader, f"{architecture}.{key}", default)

    num_experts = value("expert_count", 0)
    if not num_experts:
        return None
    shared = value("expert_shared_feed_forward_length", None)
    if shared is None:  # files written before the key: the shared expert's rows
        shared_up = tensors.get("blk.0.ffn_up_shexp.weight")
        shared = int(shared_up.shape[-1]) if shared_up is not None else 0
    return MoEConfig(
        num_experts=num_experts,
        top_k=value("expert_used_count"),
        expert_size=value("expert_feed_forward_length", None) or value("feed_forward_length"),
        normalize_top_k=bool(value("expert_weights_norm", architecture in _NORMALIZED_TOP_K)),
        shared_expert_size=shared,
        shared_expert_gated=family.experts is None or family.experts.gated_shared_expert,
    )


def _sliding_layers(reader: gguf.GGUFReader, architecture: str, num_layers: int) -> list[bool]:
    """Per layer, whether it slides (given a window): attention.sliding_window_pattern's flag per
    layer, or all but every n-th layer (its number, or llama.cpp's for the architecture), or all."""
    field = reader.fields.get(f"{architecture}.attention.sliding_window_pattern")
    if field is not None and field.types[0] == gguf.GGUFValueType.ARRAY:
        flags = [bool(flag) for flag in field.contents()]
        if len(flags) != num_layers:
            raise ValueError(f"attention.sliding_window_pattern lists {len(flags)} layers, the model has {num_layers}")
        return flags
    period = (field.contents() if field is not None else None) or _WINDOW_PATTERNS.get(architecture)
    return [period is None or (index + 1) % period != 0 for index in range(num_layers)]


def _factors(tensor: Any) -> tuple[float, ...] | None:
    return None if tensor is None else tuple(dequantize(tensor).flatten().tolist())


def _rope_scaling(reader: gguf.GGUFReader, architecture: str, context_length: int, tensors: dict) -> RopeScaling | None:
    def value(key: str, default: Any = _REQUIRED) -> Any:
        return metadata(reader, f"{architecture}.rope.{key}", default)

    kind = value("scaling.type", None)
    if ROPE_FACTORS_LONG in tensors:  # Phi-3's LongRoPE: its factors as tensors
        original = value("scaling.original_context_length")
        params = {
            "rope_type": "longrope",
            "original_max_position_embeddings": original,
            "short_factor": _factors(tensors[ROPE_FACTORS_SHORT]),
            "long_factor": _factors(tensors[ROPE_FACTORS_LONG]),
        }
        if (attention_factor := value("scaling.attn_factor", None)) is not None:
            params["attention_factor"] = attention_factor
        return RopeScaling.from_hf(params, context_length)
    if kind is None:
        scale_linear = value("scale_linear", None)  # the key before rope.scaling.*
        return None if scale_linear in (None, 1.0) else RopeScaling("linear", float(scale_linear))
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(value("scaling.factor")))
    if kind == "yarn":
        params = {
            "rope_type": "yarn",
            "factor": value("scaling.factor"),
            "original_max_position_embeddings": value("scaling.original_context_length"),
            "beta_fast": value("scaling.yarn_beta_fast", None),
            "beta_slow": value("scaling.yarn_beta_slow", None),
        }
        return RopeScaling.from_hf(params, context_length)
    raise ValueError(
        f"unsupported GGUF rope scaling type {kind!r}; ember supports 'none', 'linear', 'yarn' and Phi-3's LongRoPE "
        "factors (llama3 comes as rope_freqs)"
    )
