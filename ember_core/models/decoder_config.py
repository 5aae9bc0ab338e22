"""A decoder's sizes and switches, resolved once from a family and a checkpoint's config (HF
config.json here; GGUF metadata in loaders/gguf_config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ember_core.models.family import FAMILIES, Family
from ember_core.models.rotary import Rope
from ember_core.pooling import Pooling

Activation = Literal["silu", "gelu_tanh"]
ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}
SLIDING, FULL, LINEAR, SHORT_CONV = "sliding_attention", "full_attention", "linear_attention", "conv"
# Granite 4.0-H's configs name its layers as transformers did before 5.x.
LEGACY_LAYER_TYPES = {"mamba": LINEAR, "attention": FULL}


@dataclass(frozen=True)
class LayerSpec:
    sliding_window: int | None  # None: the layer attends to every earlier position
    rope: Rope
    sparse_mlp: bool = False  # the MLP is the config's mixture of experts
    linear: bool = False  # the layer mixes tokens through the config's linear attention, not attention


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A Gated DeltaNet's sizes: q and k heads (each serving num_value_heads / num_key_heads value
    heads), their widths, and the causal convolution's kernel over the q/k/v projection."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Which q/k head value head h reads: h // (num_value_heads / num_key_heads) as Hugging Face
    # checkpoints group them, or h % num_key_heads as llama.cpp's converter reorders them (tiled).
    tiled_value_heads: bool = False

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of linear_num_key_heads ({self.num_key_heads})"
            )
        if self.conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim must be >= 1, got {self.conv_kernel}")

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_size(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_size + self.value_size


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short convolution: its kernel over the last positions, and whether its
    projections and convolution carry biases."""

    kernel: int
    bias: bool = False

    def __post_init__(self) -> None:
        if self.kernel < 1:
            raise ValueError(f"conv_L_cache must be >= 1, got {self.kernel}")


@dataclass(frozen=True)
class Mamba2Config:
    """A Mamba2 (SSD) mixer's sizes (Granite 4.0-H): num_heads heads of head_dim channels, each
    keeping a [head_dim, state_size] state; B and C shared by the heads of each of num_groups groups;
    a causal convolution over x, B and C; time steps clamped to [time_step_min, time_step_max]."""

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    conv_bias: bool = True
    projection_bias: bool = False
    time_step_min: float = 0.0
    time_step_max: float = math.inf

    def __post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba_n_heads ({self.num_heads}) must be a multiple of mamba_n_groups ({self.num_groups})")
        if self.conv_kernel < 1:
            raise ValueError(f"mamba_d_conv must be >= 1, got {self.conv_kernel}")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_size(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.inner_size + 2 * self.num_groups * self.state_size

    @property
    def projection_size(self) -> int:
        """The input projection's rows: the gate z, x B C, and one time step per head."""
        return self.inner_size + self.conv_size + self.num_heads


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: a router's softmax picks top_k of num_experts gated MLPs per token,
    whose outputs add up weighted by their probabilities (renormalised over the top k or not)."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    normalize_top_k: bool
    shared_expert_size: int = 0  # an MLP every token also runs (Qwen2-MoE: gated by a sigmoid); 0: none
    shared_expert_gated: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and the {self.num_experts} experts, got {self.top_k}")


@dataclass(frozen=True)
class DecoderConfig:
    family: Family
    vocab_size: int
    max_position_embeddings: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float = 1e-6
    activation: Activation = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    query_scale: float | None = None  # None: head_dim^-1/2
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    moe: MoEConfig | None = None  # set when some layer has sparse_mlp
    # set when some layer is recurrent: a Gated DeltaNet's sizes (Qwen3.5), a short convolution's
    # (LFM2) or a Mamba2 mixer's (Granite 4.0-H)
    linear_attention: LinearAttentionConfig | ShortConvConfig | Mamba2Config | None = None
    # Granite's multipliers: of the embeddings, of each block's output before the residual adds it,
    # and the divisor of the logits; None where the family has none.
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    pooling: Pooling | None = None  # a GGUF file's <arch>.pooling_type (pooling.py reads the others')

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        for index, layer in enumerate(self.layers):
            if layer.rope.head_dim != self.head_dim:
                raise ValueError(f"layer {index} rotates heads of {layer.rope.head_dim} dims, not head_dim {self.head_dim}")
            if layer.sliding_window is not None and layer.sliding_window < 1:
                raise ValueError(f"layer {index}: sliding_window must be >= 1, got {layer.sliding_window}")
            if layer.sparse_mlp and self.moe is None:
                raise ValueError(f"layer {index} has a mixture-of-experts MLP but the config describes no experts")
            if layer.linear and self.linear_attention is None:
                raise ValueError(f"layer {index} is a linear-attention layer but the config describes none")
        if not any(not layer.linear for layer in self.layers):
            raise ValueError("a model needs at least one attention layer")

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state per sequence instead of KV blocks."""
        return self.linear_attention is not None
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

    @property
    def embedding_scale(self) -> float | None:
        return math.sqrt(self.hidden_size) if self.family.scaled_embeddings else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        family = FAMILIES[hf_config["model_type"]]
        cfg = family.with_defaults(hf_config)
        activation = cfg.get(family.activation_key) or cfg.get("hidden_act") or "silu"
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported {family.name} activation {activation!r}; ember supports {sorted(ACTIVATIONS)}")
        num_heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        layer_types = hf_layer_types(family, cfg)
        ropes = {kind: Rope.from_hf(cfg, kind) for kind in set(layer_types)}
        window = cfg.get("sliding_window") or None
        moe = hf_moe_config(family, cfg)
        sparse = hf_sparse_layers(cfg) if moe is not None else [False] * len(layer_types)
        linear = hf_linear_layers(family, cfg)
        intermediate_size = cfg[family.mlp_size_key] if family.mixer != "short_conv" else lfm2_feed_forward_size(cfg)
        multipliers = family.multipliers
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"{family.name} checkpoints with clip_qkv are not supported (clip_qkv={cfg['clip_qkv']})")
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            hidden_size=cfg["hidden_size"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            intermediate_size=intermediate_size,
            layers=tuple(
                LayerSpec(window if kind == SLIDING else None, ropes[kind], sparse_layer, linear_layer)
                for kind, sparse_layer, linear_layer in zip(layer_types, sparse, linear)
            ),
            rms_norm_eps=cfg.get(family.norm_eps_key, 1e-6),
            activation=ACTIVATIONS[activation],
            qkv_bias=attention_bias or (family.attention_bias == "qkv" and cfg.get("qkv_bias", True)),
            o_bias=attention_bias and family.attention_bias == "config",
            mlp_bias=family.reads_mlp_bias and bool(cfg.get("mlp_bias", False)),
            query_scale=hf_query_scale(family, cfg),
            attn_logit_softcap=cfg.get("attn_logit_softcapping") if family.attn_logit_softcapping else None,
            final_logit_softcap=cfg.get("final_logit_softcapping") if family.final_logit_softcapping else None,
            tie_word_embeddings=cfg.get("tie_word_embeddings", cfg.get("tie_embedding", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            moe=moe,
            linear_attention=hf_recurrent_config(family, cfg) if any(linear) else None,
            embedding_multiplier=float(cfg["embedding_multiplier"]) if multipliers else None,
            residual_multiplier=float(cfg["residual_multiplier"]) if multipliers else None,
            logits_scaling=float(cfg["logits_scaling"]) if multipliers else None,
        )


def hf_query_scale(family: Family, cfg: dict[str, Any]) -> float | None:
    """The attention's query scale where the family sets it apart from head_dim^-1/2."""
    if family.query_pre_attn_scalar:
        return cfg["query_pre_attn_scalar"] ** -0.5
    return float(cfg["attention_multiplier"]) if family.multipliers else None


def hf_moe_config(family: Family, cfg: dict[str, Any]) -> MoEConfig | None:
    if family.experts is None:
        return None
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")  # transformers 5 writes the first
    if not num_experts:  # a dense checkpoint of a family that may have experts (Granite 4.0-H Micro)
        return None
    style = family.experts
    return MoEConfig(
        num_experts=num_experts,
        top_k=cfg["num_experts_per_tok"],
        expert_size=cfg[style.expert_size_key],
        # Granite's router takes the softmax of the top k's logits: the top k renormalised.
        normalize_top_k=bool(cfg.get("norm_topk_prob", not style.gated_shared_expert)),
        shared_expert_size=cfg.get(style.shared_expert_key) or 0,
        shared_expert_gated=style.gated_shared_expert,
    )


def hf_linear_layers(family: Family, cfg: dict[str, Any]) -> list[bool]:
    """Which layers are recurrent: `layer_types`' entries of the family's recurrent kind ("linear_attention",
    LFM2's "conv"), in a family that has them; without layer_types, Qwen3.5's full_attention_interval
    or LFM2's full_attn_idxs, as their config classes derive them."""
    num_layers = cfg["num_hidden_layers"]
    if not family.linear_attention:
        return [False] * num_layers
    recurrent = SHORT_CONV if family.mixer == "short_conv" else LINEAR
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        layer_types = [LEGACY_LAYER_TYPES.get(kind, kind) for kind in layer_types]
    if layer_types is None and family.mixer == "short_conv":
        full = set(cfg.get("full_attn_idxs") or range(num_layers))
        return [index not in full for index in range(num_layers)]
    if layer_types is None:
        interval = cfg.get("full_attention_interval") or 4
        return [(index + 1) % interval != 0 for index in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {recurrent, FULL}:
        raise ValueError(f"config.json: layer_types must list {recurrent!r} or {FULL!r} for each of the {num_layers} layers")
    return [kind == recurrent for kind in layer_types]


def lfm2_feed_forward_size(cfg: dict[str, Any]) -> int:
    """LFM2's MLP width as its config class adjusts it: 2/3 of block_ff_dim, times
    block_ffn_dim_multiplier, rounded up to block_multiple_of."""
    size = cfg.get("block_ff_dim") or cfg["intermediate_size"]
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    if cfg.get("block_ffn_dim_multiplier") is not None:
        size = int(cfg["block_ffn_dim_multiplier"] * size)
        multiple = cfg.get("block_multiple_of", 256)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def hf_recurrent_config(family: Family, cfg: dict[str, Any]) -> LinearAttentionConfig | ShortConvConfig | Mamba2Config:
    if family.mixer == "short_conv":
        return ShortConvConfig(kernel=cfg.get("conv_L_cache", 3), bias=bool(cfg.get("conv_bias", False)))
    if family.mixer == "mamba2":
        return hf_mamba2_config(cfg)
    return LinearAttentionConfig(
        num_key_heads=cfg["linear_num_key_heads"],
        num_value_heads=cfg["linear_num_value_heads"],
        key_head_dim=cfg["linear_key_head_dim"],
        value_head_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg["linear_conv_kernel_dim"],
    )


def hf_mamba2_config(cfg: dict[str, Any]) -> Mamba2Config:
    """GraniteMoeHybridConfig's mamba_* keys: mamba_expand * hidden_size channels in mamba_n_heads
    heads (mamba_d_head "auto" divides them), time steps clamped to time_step_limit."""
    num_heads = cfg["mamba_n_heads"]
    inner = cfg["mamba_expand"] * cfg["hidden_size"]
    head_dim = cfg.get("mamba_d_head")
    if head_dim in (None, "auto"):
        head_dim = inner // num_heads
    if head_dim * num_heads != inner:
        raise ValueError(f"mamba_n_heads ({num_heads}) x mamba_d_head ({head_dim}) must be mamba_expand x hidden_size ({inner})")
    low, high = cfg.get("time_step_limit") or (0.0, math.inf)
    return Mamba2Config(
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=cfg["mamba_d_state"],
        num_groups=cfg["mamba_n_groups"],
        conv_kernel=cfg["mamba_d_conv"],
        conv_bias=bool(cfg["mamba_conv_bias"]),
        projection_bias=bool(cfg["mamba_proj_bias"]),
        time_step_min=_json_float(low),
        time_step_max=_json_float(high),
    )


def _json_float(value: float | dict[str, str]) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def hf_sparse_layers(cfg: dict[str, Any]) -> list[bool]:
    """Which layers' MLPs are the experts, as Qwen-MoE's decoder_sparse_step and mlp_only_layers say
    (every layer where the config has neither)."""
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    return [index not in dense and (index + 1) % step == 0 for index in range(cfg["num_hidden_layers"])]


def hf_layer_types(family: Family, cfg: dict[str, Any]) -> list[str]:
    """SLIDING or FULL per layer: config.json's `layer_types`, else the family's rule for older configs."""
    num_layers = cfg["num_hidden_layers"]
    if not cfg.get("sliding_window") or family.window_layers == "none":
        return [FULL] * num_layers
    if family.window_layers == "all":  # Mistral's and Phi-3's attention ignore layer_types
        return [SLIDING] * num_layers
    if family.window_layers in ("from_max_window_layers", "all_when_used") and not cfg.get("use_sliding_window"):
        return [FULL] * num_layers
    if family.window_layers == "all_when_used":
        return [SLIDING] * num_layers
    if cfg.get("layer_types") is not None:
        layer_types = list(cfg["layer_types"])
        if len(layer_types) != num_layers or not set(layer_types) <= {SLIDING, FULL}:
            raise ValueError(f"config.json: layer_types must list {SLIDING!r} or {FULL!r} for each of the {num_layers} layers")
        return layer_types
    if family.window_layers == "from_max_window_layers":
        return [SLIDING if i >= cfg["max_window_layers"] else FULL for i in range(num_layers)]
    if family.window_layers == "pattern":
        pattern = cfg.get("_sliding_window_pattern") or cfg["sliding_window_pattern"]  # transformers 5 writes the first
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    return [FULL] * num_layers
