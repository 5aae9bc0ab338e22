"""What llama.cpp's convert_hf_to_gguf.py does differently per family, as one row each: the GGUF
architecture, the hyperparameter keys it writes, the weight transformations and extra tensors.

Differences from convert_hf_to_gguf.py, each so that the file means what the checkpoint means:
gemma2 also writes `rope.freq_base` (convert leaves llama.cpp's default 10,000), and gemma2/gemma3
write `attention.sliding_window_pattern` when the checkpoint's layer_types differ from the pattern
llama.cpp assumes (every 2nd / every 6th layer global).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch

from ember_bench.families import FAMILIES
from ember_core.models.decoder_config import lfm2_feed_forward_size

Config = dict[str, Any]


@dataclass(frozen=True)
class GGUFFamily:
    arch: gguf.MODEL_ARCH
    write_hparams: Callable[[Config, gguf.GGUFWriter], None]
    permute_qk: bool = False  # llama.cpp's llama rope pairs dims (i, i+1); HF rotates halves
    norm_shift: float = 0.0  # Gemma's RMSNorm scales by (1 + w); llama.cpp by w
    conv1d_weights: bool = False  # GPT-2 stores linear weights [in, out]
    output_must_be_tied: bool = False  # llama.cpp's gemma2 always reuses token_embd as the output
    extra_tensors: Callable[[Config], list[tuple[str, np.ndarray]]] = field(default=lambda config: [])
    # A family's own tensor changes after the ones above (checkpoint name, float32 values, config).
    reshape_tensor: Callable[[str, torch.Tensor, Config], torch.Tensor] | None = None
    rename: Callable[[str], str] = field(default=lambda name: name)  # a checkpoint name the name map lacks
    # A checkpoint tensor the converter writes as several (Granite's fused gate and up): per part, a
    # name the map knows and its rows of the (transformed) tensor; None where it writes one.
    split_tensor: Callable[[str, Config], list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] | None] = field(
        default=lambda name, config: None
    )
    vocab_multiple: int = 1  # the converter pads the vocabulary to a multiple of it (Mamba2's 8)


def rope_parameters(config: Config) -> Config:
    """The full-attention RoPE parameters, from transformers 5's rope_parameters or the older
    rope_scaling + rope_theta; rope_type is set when scaling is."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = dict(params.get("full_attention", params))
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if key not in params and config.get(key) is not None:
            params[key] = config[key]
    return params


def head_dim(config: Config) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _decoder_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    """convert_hf_to_gguf.py's TextModel.set_gguf_parameters, for the keys these families have."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    rope = rope_parameters(config)
    _add_rope_scaling(rope, writer)
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    swa_rope = (config.get("rope_parameters") or {}).get("sliding_attention", {})
    if swa_rope.get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(swa_rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])


def _add_rope_scaling(rope: Config, writer: gguf.GGUFWriter) -> None:
    kind = (rope.get("rope_type") or "default").lower()
    factor = rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        optional = {
            "extrapolation_factor": writer.add_rope_scaling_yarn_ext_factor,
            "attention_factor": writer.add_rope_scaling_yarn_attn_factor,
            "beta_fast": writer.add_rope_scaling_yarn_beta_fast,
            "beta_slow": writer.add_rope_scaling_yarn_beta_slow,
        }
        for key, add in optional.items():
            if rope.get(key) is not None:
                add(rope[key])
    elif kind in ("longrope", "su"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    elif kind not in ("default", "llama3", "dynamic"):  # llama3 is the rope_freqs tensor
        raise ValueError(f"unsupported RoPE type {kind!r}; supported: default, linear, yarn, longrope, llama3, dynamic")


def _llama_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    _decoder_hparams(config, writer)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim(config))


def _llama3_rope_freqs(config: Config) -> list[tuple[str, np.ndarray]]:
    """Llama 3.1's frequency-dependent RoPE scaling, as per-dimension divisors of the frequency."""
    rope = rope_parameters(config)
    if (rope.get("rope_type") or "").lower() != "llama3":
        return []
    dim = head_dim(config)
    base = rope.get("rope_theta", 10000.0)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return [("rope_freqs.weight", np.asarray(factors, dtype=np.float32))]


def _sliding_layers(config: Config) -> list[bool]:
    return [kind == "sliding_attention" for kind in config.get("layer_types") or []]


def _add_sliding_window(config: Config, writer: gguf.GGUFWriter, llama_cpp_period: int) -> None:
    """The window, and the per-layer pattern when llama.cpp's fixed one would be wrong."""
    writer.add_sliding_window(config["sliding_window"])
    sliding = _sliding_layers(config)
    assumed = [layer % llama_cpp_period < llama_cpp_period - 1 for layer in range(config["num_hidden_layers"])]
    if sliding and sliding != assumed:
        writer.add_sliding_window_pattern(sliding)


def _expert_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    """A mixture of experts' keys. expert_weights_norm is written for every architecture (llama.cpp
    itself fixes it per architecture: renormalised for Mixtral and Qwen3-MoE, not for Qwen2-MoE and
    OLMoE); ember reads it, so a checkpoint whose norm_topk_prob differs keeps its meaning."""
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    always_normalized = config.get("model_type") in ("mixtral", "qwen3_5_moe_text")
    writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", always_normalized)))


def _mixtral_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    _llama_hparams(config, writer)
    _expert_hparams(config, writer)


def _moe_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    _decoder_hparams(config, writer)
    _expert_hparams(config, writer)


def _gemma2_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    _decoder_hparams(config, writer)
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    _add_sliding_window(config, writer, llama_cpp_period=2)


def _gemma3_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError("gemma3 has no attention logit soft-capping in llama.cpp; attn_logit_softcapping must be null")
    _decoder_hparams(config, writer)
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if any(_sliding_layers(config)):  # without the key llama.cpp runs every layer global
        _add_sliding_window(config, writer, llama_cpp_period=6)


def _phi3_rope(config: Config) -> tuple[Config, int, int]:
    rope = rope_parameters(config)
    rotary_dims = int(rope.get("partial_rotary_factor", 1.0) * config["hidden_size"]) // config["num_attention_heads"]
    original_context = rope.get("original_max_position_embeddings", config["max_position_embeddings"])
    return rope, rotary_dims, original_context


def _phi3_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    rope, rotary_dims, original_context = _phi3_rope(config)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(original_context)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(rotary_dims)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)  # 0 marks Phi-4: no window
    if rope.get("long_factor"):
        scale = config["max_position_embeddings"] / original_context
        kind = rope["rope_type"].lower()
        if kind not in ("longrope", "su", "yarn"):
            raise ValueError(f"phi3 long/short RoPE factors with rope type {kind!r}; expected longrope or yarn")
        if scale <= 1.0:
            attn_factor = 1.0
        elif kind == "yarn":
            attn_factor = 0.1 * math.log(scale) + 1.0
        else:
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(original_context))
        writer.add_rope_scaling_attn_factors(attn_factor)


def _phi3_rope_factors(config: Config) -> list[tuple[str, np.ndarray]]:
    rope, rotary_dims, _ = _phi3_rope(config)
    if not rope.get("long_factor"):
        return []
    long_factors, short_factors = rope["long_factor"], rope.get("short_factor") or []
    if len(long_factors) != rotary_dims // 2 or len(short_factors) != rotary_dims // 2:
        raise ValueError(
            f"phi3 long_factor and short_factor must have {rotary_dims // 2} entries each, "
            f"got {len(long_factors)} and {len(short_factors)}"
        )
    return [
        ("rope_factors_long.weight", np.asarray(long_factors, dtype=np.float32)),
        ("rope_factors_short.weight", np.asarray(short_factors, dtype=np.float32)),
    ]


def _gpt2_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config.get("n_ctx") or config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])


def _qwen35_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    """Qwen3_5TextModel's keys: the Gated DeltaNet's sizes as ssm.*, which layers are recurrent, the
    partial rotary and the MRoPE sections (text positions make every section turn alike)."""
    _decoder_hparams(config, writer)
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [kind == "linear_attention" for kind in config["layer_types"]])
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(int(head_dim(config) * rope_parameters(config).get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_sections([11, 11, 10, 0])


def _qwen35moe_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    _qwen35_hparams(config, writer)
    _expert_hparams(config, writer)


def _tiled_value_heads(data: torch.Tensor, dim: int, config: Config, head_size: int) -> torch.Tensor:
    """Value heads along dim from grouped by key head [k0: v0 v1, k1: v0 v1] to the tiled order the
    converter writes for ggml's broadcast [k0 v0, k1 v0, k0 v1, k1 v1]."""
    num_key_heads, num_value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if num_key_heads == num_value_heads:
        return data
    shape = list(data.shape)
    grouped = data.reshape(*shape[:dim], num_key_heads, num_value_heads // num_key_heads, head_size, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _qwen35_tensor(hf_name: str, data: torch.Tensor, config: Config) -> torch.Tensor:
    """_LinearAttentionVReorderBase and Qwen3NextModel.modify_tensors: norms stored as the (1 + w) they
    scale by (the Gated DeltaNet's own norm as w), -exp(A_log), the convolution as [channels,
    kernel], and every value-head axis tiled."""
    value_dim, key_size = config["linear_value_head_dim"], config["linear_key_head_dim"] * config["linear_num_key_heads"]
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        return data + 1
    if hf_name.endswith(".A_log"):
        return _tiled_value_heads(-torch.exp(data), 0, config, 1)
    if hf_name.endswith((".dt_bias", ".in_proj_b.weight", ".in_proj_a.weight")):
        return _tiled_value_heads(data, 0, config, 1)
    if hf_name.endswith(".in_proj_z.weight"):
        return _tiled_value_heads(data, 0, config, value_dim)
    if hf_name.endswith(".out_proj.weight"):
        return _tiled_value_heads(data, 1, config, value_dim)
    if hf_name.endswith(".conv1d.weight"):  # [channels, 1, kernel] -> [channels, kernel]
        data = data.squeeze(1)
    if hf_name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):  # q and k rows stay, v rows tile
        return torch.cat([data[: 2 * key_size], _tiled_value_heads(data[2 * key_size :], 0, config, value_dim)])
    return data


def _lfm2_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    """LFM2Model's keys: KV heads per layer (0 for a convolution layer), the convolution's cache
    length, its epsilon key and its adjusted MLP width."""
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    _decoder_hparams({
        **config, "rms_norm_eps": config["norm_eps"], "intermediate_size": lfm2_feed_forward_size(config),
        "num_key_value_heads": [kv_heads if kind != "conv" else 0 for kind in config["layer_types"]],
    }, writer)  # fmt: skip
    writer.add_vocab_size(config["vocab_size"])
    writer.add_shortconv_l_cache(config["conv_L_cache"])


def _lfm2_tensor(hf_name: str, data: torch.Tensor, config: Config) -> torch.Tensor:
    return data.squeeze(1) if "conv.conv" in hf_name and data.dim() == 3 else data


def _granite_hybrid_hparams(config: Config, writer: gguf.GGUFWriter) -> None:
    """GraniteHybridModel's keys: Llama's without head_dim (Granite ignores it), KV heads per layer (0
    for a Mamba2 layer), the experts' counts (0 for a dense model), Granite's multipliers as scales,
    the shared MLP's width, the Mamba2 sizes as ssm.*, and no RoPE unless position_embedding_type says."""
    attention = [kind in ("attention", "full_attention") for kind in config["layer_types"]]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    rotates = config.get("position_embedding_type") == "rope"
    _decoder_hparams({
        **config, "head_dim": None, "num_key_value_heads": [kv_heads if layer else 0 for layer in attention],
        "max_position_embeddings": config["max_position_embeddings"] if rotates else 2**20,
    }, writer)  # fmt: skip
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    for key, add in (
        ("attention_multiplier", writer.add_attention_scale), ("embedding_multiplier", writer.add_embedding_scale),
        ("residual_multiplier", writer.add_residual_scale), ("logits_scaling", writer.add_logit_scale),
    ):
        if config.get(key):
            add(config[key])
    writer.add_expert_shared_feed_forward_length(config["shared_intermediate_size"])
    inner = config["mamba_expand"] * config["hidden_size"]
    writer.add_ssm_conv_kernel(config["mamba_d_conv"])
    writer.add_ssm_state_size(config["mamba_d_state"])
    writer.add_ssm_group_count(config["mamba_n_groups"])
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(config["mamba_n_heads"])
    if not rotates:
        writer.add_rope_scaling_finetuned(False)


def _granite_hybrid_tensor(hf_name: str, data: torch.Tensor, config: Config) -> torch.Tensor:
    """Mamba2Model.modify_tensors: the convolution as [channels, kernel], -exp(A_log) and D as
    [heads, 1], the gated norm's weight per group."""
    if hf_name.endswith(".mamba.conv1d.weight"):
        return data.squeeze(1)
    if hf_name.endswith(".mamba.A_log"):
        return -torch.exp(data).reshape(-1, 1)
    if hf_name.endswith(".mamba.D"):
        return data.reshape(-1, 1)
    if hf_name.endswith(".mamba.norm.weight"):
        return data.reshape(config["mamba_n_groups"], -1)
    return data


def _granite_hybrid_split(hf_name: str, config: Config) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] | None:
    """GraniteMoeModel.modify_tensors: the experts' and the shared MLP's input_linear apart into gate
    and up rows; a dense model's shared MLP under the plain MLP's names."""
    layer = hf_name.rsplit(".", 3)[0]  # model.layers.N
    sparse = bool(config.get("num_local_experts"))
    if hf_name.endswith(".block_sparse_moe.input_linear.weight"):
        size = config["intermediate_size"]
        return [(f"{layer}.mlp.experts.gate_proj.weight", lambda t: t[:, :size]),
                (f"{layer}.mlp.experts.up_proj.weight", lambda t: t[:, size:])]  # fmt: skip
    if hf_name.endswith(".shared_mlp.input_linear.weight"):
        size, mlp = config["shared_intermediate_size"], "mlp.shared_expert" if sparse else "mlp"
        return [(f"{layer}.{mlp}.gate_proj.weight", lambda t: t[:size]), (f"{layer}.{mlp}.up_proj.weight", lambda t: t[size:])]
    if hf_name.endswith(".shared_mlp.output_linear.weight") and not sparse:
        return [(f"{layer}.mlp.down_proj.weight", lambda t: t)]
    return None


def _qwen35_name(name: str) -> str:
    return name.replace(".linear_attn.dt_bias", ".linear_attn.dt_proj.bias")


_LLAMA = GGUFFamily(gguf.MODEL_ARCH.LLAMA, _llama_hparams, permute_qk=True, extra_tensors=_llama3_rope_freqs)

# family (ember_bench.families) -> how its GGUF is written
GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,  # llama.cpp has no sliding window for the llama architecture
    "qwen2": GGUFFamily(gguf.MODEL_ARCH.QWEN2, _decoder_hparams),
    "qwen3": GGUFFamily(gguf.MODEL_ARCH.QWEN3, _decoder_hparams),
    "olmo2": GGUFFamily(gguf.MODEL_ARCH.OLMO2, _decoder_hparams),
    "mixtral": GGUFFamily(gguf.MODEL_ARCH.LLAMA, _mixtral_hparams, permute_qk=True),
    "qwen2_moe": GGUFFamily(gguf.MODEL_ARCH.QWEN2MOE, _moe_hparams),
    "qwen3_moe": GGUFFamily(gguf.MODEL_ARCH.QWEN3MOE, _moe_hparams),
    "olmoe": GGUFFamily(gguf.MODEL_ARCH.OLMOE, _moe_hparams),
    "gemma2": GGUFFamily(gguf.MODEL_ARCH.GEMMA2, _gemma2_hparams, norm_shift=1.0, output_must_be_tied=True),
    "gemma3": GGUFFamily(gguf.MODEL_ARCH.GEMMA3, _gemma3_hparams, norm_shift=1.0),
    "phi3": GGUFFamily(gguf.MODEL_ARCH.PHI3, _phi3_hparams, extra_tensors=_phi3_rope_factors),
    "gpt2": GGUFFamily(gguf.MODEL_ARCH.GPT2, _gpt2_hparams, conv1d_weights=True),
    "qwen3_5": GGUFFamily(gguf.MODEL_ARCH.QWEN35, _qwen35_hparams, reshape_tensor=_qwen35_tensor, rename=_qwen35_name),
    "qwen3_5_moe": GGUFFamily(
        gguf.MODEL_ARCH.QWEN35MOE, _qwen35moe_hparams, reshape_tensor=_qwen35_tensor, rename=_qwen35_name,
    ),
    "lfm2": GGUFFamily(gguf.MODEL_ARCH.LFM2, _lfm2_hparams, reshape_tensor=_lfm2_tensor),
    "granitemoehybrid": GGUFFamily(
        gguf.MODEL_ARCH.GRANITE_HYBRID, _granite_hybrid_hparams, permute_qk=True, reshape_tensor=_granite_hybrid_tensor,
        rename=lambda name: name.replace(".mamba.dt_bias", ".mamba.dt_proj.bias"), split_tensor=_granite_hybrid_split,
        vocab_multiple=8,
    ),
}
# config.json `architectures[0]` (the family's transformers model class) -> how its GGUF is written
_BY_ARCHITECTURE = {FAMILIES[name].model_class: family for name, family in GGUF_FAMILIES.items()}


def family_of(config: Config) -> GGUFFamily:
    architectures = config.get("architectures") or []
    if not architectures or architectures[0] not in _BY_ARCHITECTURE:
        raise ValueError(
            f"cannot export architecture {architectures[0] if architectures else None!r} to GGUF; "
            f"supported: {', '.join(_BY_ARCHITECTURE)}"
        )
    return _BY_ARCHITECTURE[architectures[0]]
