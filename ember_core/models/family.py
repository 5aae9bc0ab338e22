"""The Llama-like model families as data: the handful of switches in which they differ, read by the
one decoder (models/decoder.py), the checkpoint loaders and the fused C++ decode layer.

A new family is a row here and a test against transformers' own class with random weights. What a
checkpoint's config.json sets (sizes, windows, soft-cap values, RoPE) is read from it; a family says
how to read it and what its architecture fixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# Where a layer's RMSNorms sit: before / after attention, before / after the MLP.
NormSlot = Literal["attn_in", "attn_out", "mlp_in", "mlp_out"]
NORM_SLOTS: tuple[NormSlot, ...] = ("attn_in", "attn_out", "mlp_in", "mlp_out")
# Which layers slide when config.json has no `layer_types` (configs written before transformers 4.5x):
# none; all of them when `sliding_window` is set; Qwen's layers from `max_window_layers` on when
# `use_sliding_window`; all of them when `use_sliding_window` (Qwen3-MoE, whose attention ignores
# max_window_layers); all but every `sliding_window_pattern`-th (Gemma 2: 2, Gemma 3: 6).
WindowLayers = Literal["none", "all", "from_max_window_layers", "all_when_used", "pattern"]


@dataclass(frozen=True)
class ExpertStyle:
    """How a mixture-of-experts family's checkpoints name and size the sparse MLP."""

    block: str = "mlp"  # the MLP's name under model.layers.N (Mixtral: block_sparse_moe)
    # Each expert's gate, up and down projections (Mixtral: w1, w3, w2), as experts.E.<name>.weight.
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    expert_size_key: str = "moe_intermediate_size"  # an expert's intermediate size in config.json
    # The shared expert every token also runs: its width's key, and whether a sigmoid gates it
    # (Qwen2-MoE's does; Granite's shared MLP adds ungated).
    shared_expert_key: str = "shared_expert_intermediate_size"
    gated_shared_expert: bool = True


@dataclass(frozen=True)
class Family:
    name: str
    # The checkpoint's name of each norm a layer has, by slot; a slot not listed has no norm.
    norms: tuple[tuple[NormSlot, str], ...]
    # Gemma's norms multiply by (1 + w) and store w: the loaders add this to the HF weights.
    norm_weight_offset: float = 0.0
    # q and k RMSNorms after their projections: over each head (Qwen 3, Gemma 3), or over the whole
    # projection (OLMo 2).
    qk_norm: Literal["none", "head", "projection"] = "none"
    # "config": q, k, v and o take config.json's attention_bias; "qkv": q, k and v carry a bias
    # (unless config.json's qkv_bias, Qwen2-MoE's, says not) and o never does (Qwen 2).
    attention_bias: Literal["config", "qkv"] = "config"
    # Whether config.json's mlp_bias is read (Llama); elsewhere the MLP has no bias.
    reads_mlp_bias: bool = False
    activation_key: str = "hidden_act"
    # Checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3).
    fused_checkpoint: bool = False
    # Embeddings scaled by sqrt(hidden_size), queries by query_pre_attn_scalar^-1/2 (Gemma).
    scaled_embeddings: bool = False
    query_pre_attn_scalar: bool = False
    # Attention logits soft-capped by config.json's attn_logit_softcapping (Gemma 2; Gemma 3's
    # attention ignores the key).
    attn_logit_softcapping: bool = False
    final_logit_softcapping: bool = False
    window_layers: WindowLayers = "none"
    # What transformers' config class of the family assumes for keys config.json omits.
    config_defaults: tuple[tuple[str, Any], ...] = ()
    # Whether llama.cpp's converter interleaves q/k rows for its rope (the `llama` architecture).
    gguf_permuted_qk: bool = False
    # Set for mixture-of-experts families: their MLPs (all, or as decoder_sparse_step and
    # mlp_only_layers say) route each token to a few experts.
    experts: ExpertStyle | None = None
    # Attention multiplies its output by sigmoid of a gate that q_proj computes beside each head's
    # query (q_proj's rows per head: query, then gate): Qwen3.5, Qwen3-Next.
    gated_attention: bool = False
    # Some layers mix tokens through a recurrent state instead of attention: Qwen3.5's Gated DeltaNet
    # where `layer_types` says "linear_attention" (layers/gated_delta_net.py), LFM2's short
    # convolution where it says "conv" (layers/short_conv.py), Granite 4.0-H's Mamba2 where it says
    # "linear_attention" or "mamba" (layers/mamba2.py); mixer_name is that module's checkpoint name
    # under model.layers.N.
    linear_attention: bool = False
    mixer: Literal["gated_delta_net", "short_conv", "mamba2"] = "gated_delta_net"
    mixer_name: str = "linear_attn"
    # ember's module path -> the checkpoint's, within a layer (`self_attn.o_proj`) or at the top
    # (`norm`), where a family names them apart from the Llama-like ones (LFM2).
    checkpoint_names: tuple[tuple[str, str], ...] = ()
    # A checkpoint tensor (its path within a layer) stored fused -> the paths its rows split into,
    # equally; a stacked [experts, rows, columns] tensor splits per expert too ({expert} in the path).
    checkpoint_splits: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Granite's multipliers in config.json: embedding_multiplier, attention_multiplier (the query
    # scale), residual_multiplier (of each block's output) and logits_scaling (the logits' divisor).
    multipliers: bool = False
    mlp_size_key: str = "intermediate_size"  # config.json's key of the dense MLP's width
    norm_eps_key: str = "rms_norm_eps"  # config.json's key of the RMSNorms' epsilon
    gguf_output_norm: str = "output_norm"  # llama.cpp's name of the final norm (LFM2: token_embd_norm)
    # Checkpoint tensors of parts ember does not run: a multimodal checkpoint's vision tower, a
    # multi-token-prediction head.
    ignored_weights: tuple[str, ...] = ()
    # The slot of llama.cpp's post_attention_norm tensor: a norm after attention (Gemma, OLMo 2), or
    # the MLP's input norm where the converter names Qwen3.5's post_attention_layernorm so.
    gguf_post_attention_norm: NormSlot = "attn_out"

    def checkpoint_name(self, name: str) -> str:
        """A parameter's name in ember's Llama-like spelling (`layers.0.self_attn.o_proj.weight`) as
        the family's checkpoints spell it."""
        renames = dict(self.checkpoint_names)
        if not renames:
            return name
        module, _, kind = name.rpartition(".")
        if module.startswith("layers."):
            _, index, path = module.split(".", 2)
            return f"layers.{index}.{renames.get(path, path)}.{kind}"
        return f"{renames.get(module, module)}.{kind}"

    def split_checkpoint_tensor(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """A checkpoint tensor (name without `model.`) as the parts checkpoint_splits names; itself
        where the family stores it unfused."""
        module, _, kind = name.rpartition(".")
        if not (self.checkpoint_splits and module.startswith("layers.")):
            return [(name, tensor)]
        _, index, path = module.split(".", 2)
        paths = dict(self.checkpoint_splits).get(path)
        if paths is None:
            return [(name, tensor)]
        parts = tensor.chunk(len(paths), dim=-2)
        if tensor.dim() == 3:
            return [
                (f"layers.{index}.{part_path.format(expert=expert)}.{kind}", part[expert])
                for part_path, part in zip(paths, parts)
                for expert in range(tensor.shape[0])
            ]
        return [(f"layers.{index}.{part_path}.{kind}", part) for part_path, part in zip(paths, parts)]

    def fused_in_checkpoint(self, parts: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """A linear's parts (module name, rows) as the checkpoint names its modules: one fused module
        where checkpoint_splits splits it into these parts (Granite's shared_mlp.input_linear)."""
        for fused, paths in self.checkpoint_splits:
            if len(parts) == len(paths) and all(name.endswith(f".{path}") for (name, _), path in zip(parts, paths)):
                prefix = parts[0][0].removesuffix(paths[0])
                return [(prefix + fused, sum(rows for _, rows in parts))]
        return parts

    def norm_name(self, slot: NormSlot) -> str | None:
        return dict(self.norms).get(slot)

    def with_defaults(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """config.json's keys over the family's defaults (a key set to null stays null)."""
        return {**dict(self.config_defaults), **hf_config}


_LLAMA_NORMS: tuple[tuple[NormSlot, str], ...] = (("attn_in", "input_layernorm"), ("mlp_in", "post_attention_layernorm"))
_GEMMA_NORMS: tuple[tuple[NormSlot, str], ...] = (
    ("attn_in", "input_layernorm"),
    ("attn_out", "post_attention_layernorm"),
    ("mlp_in", "pre_feedforward_layernorm"),
    ("mlp_out", "post_feedforward_layernorm"),
)
_GEMMA = dict(
    norms=_GEMMA_NORMS, norm_weight_offset=1.0, activation_key="hidden_activation", scaled_embeddings=True,
    query_pre_attn_scalar=True, final_logit_softcapping=True, window_layers="pattern",
)
_GEMMA_DEFAULTS = (
    ("head_dim", 256), ("hidden_activation", "gelu_pytorch_tanh"), ("query_pre_attn_scalar", 256),
    ("sliding_window", 4096), ("tie_word_embeddings", True),
)
_QWEN_DEFAULTS = (("use_sliding_window", False), ("sliding_window", 4096), ("max_window_layers", 28))
_QWEN3_5 = dict(
    norms=_LLAMA_NORMS, norm_weight_offset=1.0, qk_norm="head", gated_attention=True, linear_attention=True,
    ignored_weights=("mtp.", "model.visual."), gguf_post_attention_norm="mlp_in",
)
_QWEN3_5_DEFAULTS = (("head_dim", 256), ("linear_conv_kernel_dim", 4))
_MIXTRAL_EXPERTS = ExpertStyle("block_sparse_moe", ("w1", "w3", "w2"), "intermediate_size")
# Granite 4.0-H: its dense MLP (the MoE's shared expert) is shared_mlp, gate and up in input_linear;
# the experts stacked in block_sparse_moe.input_linear / output_linear (what GGUF files keep apart).
_GRANITE_SHARED_MLP = (("gate_proj", "shared_mlp.gate_proj"), ("up_proj", "shared_mlp.up_proj"), ("down_proj", "shared_mlp.output_linear"))
_GRANITE_HYBRID = dict(
    norms=_LLAMA_NORMS, linear_attention=True, mixer="mamba2", mixer_name="mamba", multipliers=True,
    gguf_permuted_qk=True, mlp_size_key="shared_intermediate_size",
    experts=ExpertStyle(
        "block_sparse_moe", expert_size_key="intermediate_size", shared_expert_key="shared_intermediate_size",
        gated_shared_expert=False,
    ),
    checkpoint_names=tuple(
        (f"{parent}.{ours}", theirs) for parent in ("mlp", "mlp.shared_expert") for ours, theirs in _GRANITE_SHARED_MLP
    ),
    checkpoint_splits=(
        ("shared_mlp.input_linear", ("shared_mlp.gate_proj", "shared_mlp.up_proj")),
        ("block_sparse_moe.input_linear", (
            "block_sparse_moe.experts.{expert}.gate_proj", "block_sparse_moe.experts.{expert}.up_proj",
        )),
        ("block_sparse_moe.output_linear", ("block_sparse_moe.experts.{expert}.down_proj",)),
        ("block_sparse_moe.router.layer", ("block_sparse_moe.gate",)),
    ),
    config_defaults=(  # GraniteMoeHybridConfig's; no position_embedding_type: no RoPE
        ("position_embedding_type", None), ("num_local_experts", 8), ("num_experts_per_tok", 2),
        ("shared_intermediate_size", 1024), ("mamba_n_heads", 128), ("mamba_n_groups", 1), ("mamba_d_state", 256),
        ("mamba_d_conv", 4), ("mamba_expand", 2), ("mamba_conv_bias", True), ("mamba_proj_bias", False),
        ("embedding_multiplier", 1.0), ("attention_multiplier", 1.0), ("residual_multiplier", 1.0),
        ("logits_scaling", 1.0),
    ),
)  # fmt: skip

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", _LLAMA_NORMS, reads_mlp_bias=True, gguf_permuted_qk=True),
        Family("mistral", _LLAMA_NORMS, window_layers="all", config_defaults=(("sliding_window", 4096),),
               gguf_permuted_qk=True),
        Family("qwen2", _LLAMA_NORMS, attention_bias="qkv", window_layers="from_max_window_layers",
               config_defaults=_QWEN_DEFAULTS),
        Family("qwen3", _LLAMA_NORMS, qk_norm="head", window_layers="from_max_window_layers",
               config_defaults=(*_QWEN_DEFAULTS, ("head_dim", 128))),
        Family("gemma2", **_GEMMA, attn_logit_softcapping=True, config_defaults=(
            *_GEMMA_DEFAULTS, ("sliding_window_pattern", 2), ("attn_logit_softcapping", 50.0),
            ("final_logit_softcapping", 30.0),
        )),
        Family("gemma3_text", **_GEMMA, qk_norm="head", config_defaults=(
            *_GEMMA_DEFAULTS, ("sliding_window_pattern", 6), ("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10_000.0),
        )),
        Family("phi3", _LLAMA_NORMS, fused_checkpoint=True, window_layers="all"),
        Family("olmo2", (("attn_out", "post_attention_layernorm"), ("mlp_out", "post_feedforward_layernorm")),
               qk_norm="projection"),
        # Mixtral always renormalises its top-k weights; the others as norm_topk_prob says.
        Family("mixtral", _LLAMA_NORMS, window_layers="all", gguf_permuted_qk=True, experts=_MIXTRAL_EXPERTS,
               config_defaults=(("norm_topk_prob", True),)),
        Family("qwen2_moe", _LLAMA_NORMS, attention_bias="qkv", window_layers="from_max_window_layers",
               experts=ExpertStyle(), config_defaults=_QWEN_DEFAULTS),
        Family("qwen3_moe", _LLAMA_NORMS, qk_norm="head", window_layers="all_when_used",
               experts=ExpertStyle(), config_defaults=(*_QWEN_DEFAULTS, ("head_dim", 128))),
        Family("olmoe", _LLAMA_NORMS, qk_norm="projection", experts=ExpertStyle(expert_size_key="intermediate_size")),
        # Qwen3.5's norms multiply by (1 + w), as Gemma's (the Gated DeltaNet's output norm excepted);
        # its mixture of experts always renormalises the top-k weights.
        Family("qwen3_5_text", **_QWEN3_5, config_defaults=_QWEN3_5_DEFAULTS),
        Family("qwen3_5_moe_text", **_QWEN3_5, experts=ExpertStyle(),
               config_defaults=(*_QWEN3_5_DEFAULTS, ("norm_topk_prob", True))),
        # LFM2: gated short convolutions beside grouped-query attention, its own module names.
        Family("lfm2", (("attn_in", "operator_norm"), ("mlp_in", "ffn_norm")), qk_norm="head", linear_attention=True,
               mixer="short_conv", mixer_name="conv", norm_eps_key="norm_eps", gguf_output_norm="token_embd_norm",
               checkpoint_names=(
                   ("self_attn.o_proj", "self_attn.out_proj"), ("self_attn.q_norm", "self_attn.q_layernorm"),
                   ("self_attn.k_norm", "self_attn.k_layernorm"), ("mlp.gate_proj", "feed_forward.w1"),
                   ("mlp.up_proj", "feed_forward.w3"), ("mlp.down_proj", "feed_forward.w2"), ("norm", "embedding_norm"),
               ), config_defaults=(
                   ("norm_eps", 1e-5), ("conv_L_cache", 3), ("conv_bias", False), ("block_auto_adjust_ff_dim", True),
                   ("block_ffn_dim_multiplier", 1.0), ("block_multiple_of", 256), ("tie_word_embeddings", True),
               )),
        # Granite 4.0-H: Mamba2 layers beside attention without RoPE, Granite's multipliers, a shared
        # MLP with or without experts beside it.
        Family("granitemoehybrid", **_GRANITE_HYBRID),
    )
}  # fmt: skip

# llama.cpp's `general.architecture` -> family (Mistral's files say llama; Mixtral's too, with experts).
GGUF_ARCHITECTURES: dict[str, Family] = {
    "llama": FAMILIES["llama"],
    "qwen2moe": FAMILIES["qwen2_moe"],
    "qwen3moe": FAMILIES["qwen3_moe"],
    "olmoe": FAMILIES["olmoe"],
    "qwen2": FAMILIES["qwen2"],
    "qwen3": FAMILIES["qwen3"],
    "gemma2": FAMILIES["gemma2"],
    "gemma3": FAMILIES["gemma3_text"],
    "phi3": FAMILIES["phi3"],
    "olmo2": FAMILIES["olmo2"],
    "qwen35": FAMILIES["qwen3_5_text"],
    "qwen35moe": FAMILIES["qwen3_5_moe_text"],
    "lfm2": FAMILIES["lfm2"],
    "granitehybrid": FAMILIES["granitemoehybrid"],
}
