"""One decoder for the Llama-like families (Llama, Mistral, Qwen 2/3, Gemma 2/3, Phi-3, OLMo 2, and the
mixtures of experts Mixtral, Qwen2/3-MoE, OLMoE): RMSNorms where the family puts them, grouped-query
attention over the paged KV cache with optional q/k norms, biases, partial rotary, sliding windows
and soft-capped logits, and a gated MLP (SwiGLU or GeGLU) or a mixture of such MLPs (layers/moe.py).
The families differ only in DecoderConfig's switches (models/family.py).

q/k/v and gate/up run as one fused Linear each; load_weights fills them from the separate HF tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.activation import sigmoid_mul
from ember_core.layers.attention import ForwardMetadata, PagedAttention
from ember_core.layers.gated_delta_net import GatedDeltaNet
from ember_core.layers.linear import SMALL_BATCH_ROWS, kernel_operands, tied_head
from ember_core.layers.lora import AdapterRows, AdapterTarget, LoRALinear
from ember_core.layers.mamba2 import Mamba2
from ember_core.layers.mlp import MLP
from ember_core.layers.moe import SparseMoE
from ember_core.layers.recurrent_layer import RecurrentLayer
from ember_core.layers.short_conv import ShortConv
from ember_core.models.decoder_config import DecoderConfig, LayerSpec, Mamba2Config, ShortConvConfig
from ember_core.models.family import NORM_SLOTS
from ember_core.models.norm import RMSNorm
from ember_core.models.rotary import Rope, apply_rope_
from ember_core.parallel.group import TensorParallel
from ember_core.parallel.shards import DecoderShards
from ember_core.parallel.split_norm import SplitRMSNorm

_ATTENTION_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj")
# Norms whose checkpoint weight is w itself in a family whose other norms store w of (1 + w).
_NORMS_WITHOUT_OFFSET = ("linear_attn.norm.weight",)
_MLP_LINEARS = ("mlp.gate_up_proj", "mlp.down_proj")
_SHARED_EXPERT_LINEARS = ("mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj")

IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)  # saved by old transformers versions; recomputed here
# decoder_layer_'s stages for a tensor-parallel rank (kernels/decoder_layer.cpp)
_ATTENTION_PART, _MLP_PART = 1, 2


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer: LayerSpec, shards: DecoderShards | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.gated = config.family.gated_attention
        self.q_rows = 2 * self.q_size if self.gated else self.q_size  # a gated head's query, then its gate
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_rows + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        qk_norm = config.family.qk_norm
        self.q_norm = self.k_norm = None
        if qk_norm != "none":
            per_head = qk_norm == "head"
            self.q_norm = RMSNorm(config.head_dim if per_head else self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim if per_head else self.kv_size, config.rms_norm_eps)
        if qk_norm == "projection" and shards is not None:
            whole, eps = shards.config, config.rms_norm_eps
            self.q_norm = SplitRMSNorm(self.q_size, eps, shards.parallel, whole.num_heads * whole.head_dim, counted=True)
            self.k_norm = SplitRMSNorm(
                self.kv_size, eps, shards.parallel, whole.num_kv_heads * whole.head_dim, counted=shards.counts_its_kv_heads
            )
        self.attn = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim, config.scale, layer.sliding_window,
            config.attn_logit_softcap,
        )

    def qk_norm_groups(self, num_heads: int) -> int:
        """How many vectors a norm of num_heads heads' columns splits them into: one per head, or one."""
        return num_heads if self.q_norm is not None and self.q_norm.weight.shape[0] == self.head_dim else 1

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        gate = None
        if self.gated:  # [query | gate] per head: the queries go in front of k and v as ungated models have them
            query_gate = qkv[:, : self.q_rows].view(num_tokens, self.num_heads, 2, self.head_dim)
            gate = query_gate[:, :, 1].reshape(num_tokens, self.q_size)
            qkv = torch.cat([query_gate[:, :, 0].reshape(num_tokens, self.q_size), qkv[:, self.q_rows :]], dim=1)
        if self.q_norm is not None:
            for norm, start, heads in ((self.q_norm, 0, self.num_heads), (self.k_norm, self.q_size, self.num_kv_heads)):
                columns = qkv[:, start : start + heads * self.head_dim]
                norm.forward_(columns.view(num_tokens, self.qk_norm_groups(heads), -1))
        heads = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        apply_rope_(heads[:, : self.num_heads + self.num_kv_heads], cos, sin)  # one rotation for q and k
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attended = self.attn(q, k, v, meta)
        if gate is not None:
            attended = sigmoid_mul(attended, gate)
        return self.o_proj(attended)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer: LayerSpec, shards: DecoderShards | None = None) -> None:
        """config: this rank's sizes under tensor parallelism (shards), whose o and down outputs
        are then partial sums, added across ranks before the residual."""
        super().__init__()
        self.config = config
        self.parallel = None if shards is None else shards.parallel
        self.rope = layer.rope
        for slot in NORM_SLOTS:
            norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.family.norm_name(slot) else None
            setattr(self, f"{slot}_norm", norm)
        self.self_attn: Attention | None = None
        # A recurrent layer sits under its checkpoint name (linear_attn, conv); `recurrent` finds it.
        self.recurrent_name = config.family.mixer_name if layer.linear else None
        if self.recurrent_name is not None:
            self.add_module(self.recurrent_name, recurrent_layer(config))
        else:
            self.self_attn = Attention(config, layer, shards)
        self.mlp: MLP | SparseMoE
        if layer.sparse_mlp:
            self.mlp = SparseMoE(config.moe, config.hidden_size, config.activation)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.activation)

    @property
    def recurrent(self) -> RecurrentLayer | None:
        return None if self.recurrent_name is None else getattr(self, self.recurrent_name)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        if (
            meta.decodes_only_on_kernel
            and self.fused_operands is not None
            and (not meta.adapters or self.fused_adapters is not None)
            and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.shape[0] <= SMALL_BATCH_ROWS
        ):
            return self.forward_fused_(hidden, cos, sin, meta)
        return self.forward_modules(hidden, cos, sin, meta)

    def forward_modules(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        mixer_in = _normed(self.attn_in_norm, hidden)
        recurrent = self.recurrent
        if recurrent is not None:
            assert meta.states is not None
            attention = recurrent(mixer_in, meta.states)
        else:
            attention = self._summed(self.self_attn(mixer_in, cos, sin, meta))
        hidden = hidden + self._scaled(_normed(self.attn_out_norm, attention))
        return hidden + self._scaled(_normed(self.mlp_out_norm, self._summed(self.mlp(_normed(self.mlp_in_norm, hidden)))))

    def _scaled(self, block_output: torch.Tensor) -> torch.Tensor:
        """A block's output as the residual adds it: times Granite's residual_multiplier, if any."""
        multiplier = self.config.residual_multiplier
        return block_output if multiplier is None else block_output * multiplier

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.parallel is None else self.parallel.sum(partial)

    @property
    def _fused_linears(self) -> list[nn.Module]:
        """The linears decoder_layer_ runs, in its order: qkv, o, then gate_up and down unless the
        layer's MLP is a mixture of experts (its experts run after the call, from forward_fused_)."""
        attention, mlp = self.self_attn, self.mlp
        return [attention.qkv_proj, attention.o_proj] + ([] if isinstance(mlp, SparseMoE) else [mlp.gate_up_proj, mlp.down_proj])

    @functools.cached_property
    def fused_adapters(self) -> tuple[AdapterRows, tuple[torch.Tensor, ...], tuple[int, ...]] | None:
        """(the rows' slots, each linear's A, B and ranks, their parts' rows) as decoder_layer_ takes
        LoRA adapters; None when the linears are not all LoRALinears (no adapters served). Looked up
        once, as fused_operands: the stacks are filled in place when an adapter takes a slot."""
        linears = self._fused_linears
        if not all(isinstance(linear, LoRALinear) for linear in linears):
            return None
        weights = tuple(tensor for linear in linears for tensor in (linear.lora_a, linear.lora_b, linear.ranks))
        return linears[0].rows, weights, tuple(rows for linear in linears for rows in linear.parts)

    @functools.cached_property
    def fused_operands(self) -> tuple[tuple, tuple, tuple, tuple, tuple] | None:
        """(norms, weights, biases, formats, parts) as decoder_layer_ takes them; None when a linear is one it
        does not take; a mixture of experts' layer gives only the attention's linears. Looked up once: the module lookups cost ~20 us per layer, 0.6 ms of every decode
        step. The runner swaps the linears before the first step and loading copies into the same
        tensors, so they do not change afterwards."""
        attention = self.self_attn
        # decoder_layer_ knows neither a recurrent mixer, nor a gate, nor Granite's residual multiplier
        if attention is None or attention.gated or self.config.residual_multiplier is not None:
            return None
        operands = [kernel_operands(linear) for linear in self._fused_linears]
        if any(operand is None for operand in operands) or isinstance(attention.q_norm, SplitRMSNorm):
            return None
        weights = tuple(weight for part_weights, _, _ in operands for weight in part_weights)
        formats = tuple(code for _, _, codes in operands for code in codes)
        biases, parts = tuple(bias for _, bias, _ in operands), tuple(len(codes) for _, _, codes in operands)
        norms = [getattr(self, f"{slot}_norm") for slot in NORM_SLOTS] + [attention.q_norm, attention.k_norm]
        return tuple(None if norm is None else norm.weight for norm in norms), weights, biases, formats, parts

    def forward_fused_(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """forward_modules as one C++ call with the same bits (the same ops in the same order), adding
        into hidden in place; for decode steps on CPU, where the modules' eager ops cost ~20% of a step.
        A tensor-parallel rank calls it for the attention and the MLP apart, each up to its part of
        the sum the ranks add up."""
        attention = self.self_attn.attn
        group = meta.groups[attention.kv_group]
        norms, weights, biases, formats, parts = self.fused_operands
        adapters = (None, (), [], ())
        if meta.adapters:
            rows, lora_weights, part_rows = self.fused_adapters
            adapters = (rows.slots, lora_weights, rows.scales, part_rows)
        operands = (
            hidden, norms, self.config.rms_norm_eps, weights, biases, formats, parts, self.config.activation == "gelu_tanh",
            cos, sin, attention.key_cache, attention.value_cache, group.slot_mapping, group.decode_block_tables,
            group.decode_context_lens, attention.num_heads, attention.scale, attention.softcap or 0.0,
            group.sliding_window or 0, *adapters,
        )
        if self.parallel is None:
            cpu_ops.ops().decoder_layer_(*operands)
        else:
            partial = torch.empty_like(hidden)
            cpu_ops.ops().decoder_layer_(*operands, _ATTENTION_PART, partial)
            hidden += _normed(self.attn_out_norm, self.parallel.sum(partial))
            if not isinstance(self.mlp, SparseMoE):
                cpu_ops.ops().decoder_layer_(*operands, _MLP_PART, partial)
                hidden += _normed(self.mlp_out_norm, self.parallel.sum(partial))
        if isinstance(self.mlp, SparseMoE):
            hidden += _normed(self.mlp_out_norm, self._summed(self.mlp(_normed(self.mlp_in_norm, hidden))))
        return hidden


def recurrent_layer(config: DecoderConfig) -> RecurrentLayer:
    """The family's recurrent layer, sized by the config."""
    if isinstance(config.linear_attention, ShortConvConfig):
        return ShortConv(config.linear_attention, config.hidden_size)
    if isinstance(config.linear_attention, Mamba2Config):
        return Mamba2(config.linear_attention, config.hidden_size, config.rms_norm_eps)
    assert config.linear_attention is not None
    return GatedDeltaNet(config.linear_attention, config.hidden_size, config.rms_norm_eps)


def _normed(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig, parallel: TensorParallel | None = None) -> None:
        """parallel: this model is one rank's part of it (parallel/shards.py), its layers sized by
        `sizes`; config stays the whole model's."""
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.shards = None if parallel is None else DecoderShards(config, parallel)
        self.sizes = config if self.shards is None else self.shards.local_config()
        self.embed_tokens = nn.Embedding(self.sizes.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(self.sizes, layer, self.shards) for layer in config.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = tied_head(self.embed_tokens)
        else:
            self.lm_head = nn.Linear(config.hidden_size, self.sizes.vocab_size, bias=False)
        self.ropes: tuple[Rope, ...] = tuple(dict.fromkeys(layer.rope for layer in config.layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        hidden = self._embedded(input_ids)
        if self.config.embedding_scale is not None:  # as transformers: the scale rounded to the model's dtype
            hidden = hidden * torch.tensor(self.config.embedding_scale).to(hidden.dtype)
        if self.config.embedding_multiplier is not None:  # Granite's, a Python float as transformers has it
            hidden = hidden * self.config.embedding_multiplier
        tables = {
            rope: rope.cos_sin(positions, hidden.dtype, rope.use_long_table(positions, meta.prompt_lengths))
            for rope in self.ropes
        }
        for layer in self.layers:
            hidden = layer(hidden, *tables[layer.rope], meta)
        return self.norm(hidden)

    def _embedded(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) if self.shards is None else self.shards.vocab.embedded(self.embed_tokens, input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.shards is not None:
            logits = self.shards.vocab.logits(logits)
        if self.config.logits_scaling is not None:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def fused_shards(self) -> dict[str, list[tuple[str, int]]]:
        """Fused parameter -> the HF tensors stacked in its rows, in order, with their row counts."""
        c = self.sizes
        if c.family.fused_checkpoint:
            return {}
        q_rows, kv_rows = c.num_heads * c.head_dim * (2 if c.family.gated_attention else 1), c.num_kv_heads * c.head_dim
        shards = {
            "self_attn.qkv_proj": [("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv_rows), ("self_attn.v_proj", kv_rows)],
            "mlp.gate_up_proj": [("mlp.gate_proj", c.intermediate_size), ("mlp.up_proj", c.intermediate_size)],
        }
        delta_net = next((layer.recurrent for layer in self.layers if isinstance(layer.recurrent, GatedDeltaNet)), None)
        if delta_net is not None:
            name = c.family.mixer_name
            shards[f"{name}.in_proj"] = [(f"{name}.{projection}", rows) for projection, rows in delta_net.input_rows()]
        if c.moe is not None and c.moe.shared_expert_size:
            size = c.moe.shared_expert_size
            shards["mlp.shared_expert.gate_up_proj"] = [("mlp.shared_expert.gate_proj", size), ("mlp.shared_expert.up_proj", size)]
        return shards

    def adapter_targets(self) -> list[AdapterTarget]:
        """The linears a LoRA adapter may adapt, the output head aside: each layer's attention and MLP,
        a mixture of experts' attention and shared expert (its routed experts are stacked tensors,
        which no LoRALinear wraps); a fused QKV or gate/up in the parts the checkpoint stores."""
        shards = self.fused_shards()
        family = self.config.family
        targets = []
        for index, layer in enumerate(self.layers):
            paths = _ATTENTION_LINEARS
            if layer.recurrent_name is not None:
                paths = (f"{layer.recurrent_name}.in_proj", f"{layer.recurrent_name}.out_proj")
            if isinstance(layer.mlp, MLP):
                paths += _MLP_LINEARS
            elif layer.mlp.shared_expert is not None:
                paths += _SHARED_EXPERT_LINEARS
            for path in paths:
                parent_path, _, attribute = path.rpartition(".")
                parent = layer.get_submodule(parent_path)
                parts = shards.get(path, [(path, getattr(parent, attribute).out_features)])
                modules = [(f"model.{family.checkpoint_name(f'layers.{index}.{name}.weight')}".removesuffix(".weight"), rows) for name, rows in parts]
                targets.append(AdapterTarget(parent, attribute, family.fused_in_checkpoint(modules)))
        return targets

    def hf_names(self) -> dict[str, str]:
        """ember's parameter name -> the checkpoint's, where they differ by more than a fused shard or
        an expert's slice: the norms, and the router of a family whose sparse MLP is not `mlp`."""
        renames = {}
        experts = self.config.family.experts
        for index, layer in enumerate(self.config.layers):
            for slot in NORM_SLOTS:
                hf_name = self.config.family.norm_name(slot)
                if hf_name is not None:
                    renames[f"layers.{index}.{slot}_norm.weight"] = f"layers.{index}.{hf_name}.weight"
            if layer.sparse_mlp:
                renames[f"layers.{index}.mlp.gate.weight"] = f"layers.{index}.{experts.block}.gate.weight"
        return renames

    def _expert_slots(self, name: str, param: torch.Tensor) -> dict[str, tuple[torch.Tensor, tuple]]:
        """A layer's stacked experts' parameter -> each expert's checkpoint tensors in it (per expert,
        as Hugging Face checkpoints store them): gate and up rows of gate_up_proj, down_proj whole."""
        style, size = self.config.family.experts, self.sizes.moe.expert_size
        prefix = f"{name.split('.mlp.')[0]}.{style.block}.experts"
        gate, up, down = style.projections
        slots = {}
        for expert in range(param.shape[0]):
            if name.endswith("gate_up_proj"):
                slots[f"{prefix}.{expert}.{gate}.weight"] = (param, (expert, slice(0, size)))
                slots[f"{prefix}.{expert}.{up}.weight"] = (param, (expert, slice(size, 2 * size)))
            else:
                slots[f"{prefix}.{expert}.{down}.weight"] = (param, (expert,))
        return slots

    def _weight_slots(self) -> dict[str, tuple[torch.Tensor, slice | tuple]]:
        """Every expected checkpoint tensor (HF name without `model.`) -> the parameter rows it fills."""
        fused_shards, renames = self.fused_shards(), self.hf_names()
        slots: dict[str, tuple[torch.Tensor, slice | tuple]] = {}
        for name, param in self.named_parameters():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                slots.update(self._expert_slots(name, param))
                continue
            for fused, shards in fused_shards.items():
                if f".{fused}." in name:
                    start = 0
                    for shard, rows in shards:
                        slots[name.replace(fused, shard)] = (param, slice(start, start + rows))
                        start += rows
                    break
            else:
                slots[renames.get(name, name)] = (param, slice(None))
        return {self.config.family.checkpoint_name(name): slot for name, slot in slots.items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], norm_offset: float | None = None) -> None:
        """HF names (`model.layers.0.self_attn.q_proj.weight`, ..., `lm_head.weight`). norm_offset is
        added to every norm weight: by default the family's (Gemma stores w of its (1 + w)); GGUF
        files store the sum already."""
        family = self.config.family.name
        if norm_offset is None:
            norm_offset = self.config.family.norm_weight_offset
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # `to_empty` gave the head its own tensor
        slots = self._weight_slots()
        loaded: set[str] = set()
        ignored = self.config.family.ignored_weights
        for name, tensor in weights:
            if name.startswith(ignored):
                continue
            name = name.removeprefix("model.language_model.").removeprefix("model.")  # a multimodal checkpoint's, or not
            if name.endswith(IGNORED_WEIGHTS) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue  # a tied head saved anyway is the embedding again
            for part_name, part in self.config.family.split_checkpoint_tensor(name, tensor):
                self._load_one(part_name, part, slots.get(part_name), norm_offset)
                loaded.add(part_name)
        missing = slots.keys() - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {family} weights: {sorted(missing)[:5]}")

    def _load_one(self, name: str, tensor: torch.Tensor, slot: tuple[torch.Tensor, slice | tuple] | None, norm_offset: float) -> None:
        if slot is None:
            raise ValueError(f"unexpected {self.config.family.name} weight {name!r}")
        param, rows = slot
        with torch.no_grad():
            target = param[rows]
            if tensor.shape != target.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            if norm_offset and name.endswith("norm.weight") and not name.endswith(_NORMS_WITHOUT_OFFSET):
                tensor = tensor.float() + norm_offset
            target.copy_(tensor)
