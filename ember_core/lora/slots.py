"""The adapters a model holds, one slot each: the model's attention and MLP linears are wrapped in
LoRALinears once, at engine start, and an adapter is loaded by copying its A and B into a slot.

A PEFT module name maps to a linear of ember's model and a part of it: q_proj, k_proj and v_proj
are the parts of ember's fused qkv_proj, gate_proj and up_proj of gate_up_proj, as the base
weights' shards are (Decoder.fused_shards)."""

from __future__ import annotations

import torch
from torch import nn

from ember_core.layers.lora import AdapterRows, LoRALinear
from ember_core.layers.mlp import MLP
from ember_core.lora.peft_files import PeftAdapter

_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class AdapterSlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        if not hasattr(model, "fused_shards"):
            raise ValueError(f"LoRA adapters are not supported for {type(model).__name__} models")
        param = next(model.parameters())
        self.rows = AdapterRows()
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets: dict[str, tuple[LoRALinear, int]] = {}  # PEFT module name -> (linear, part)
        self._linears: list[LoRALinear] = []
        shards = model.fused_shards()
        for index, layer in enumerate(model.layers):
            for path in _LINEARS:
                if path.startswith("mlp.") and not isinstance(layer.mlp, MLP):
                    continue  # a mixture of experts: its experts take no adapter
                parent_path, _, attribute = path.rpartition(".")
                parent = layer.get_submodule(parent_path)
                parts = shards.get(path, [(path, getattr(parent, attribute).out_features)])
                linear = LoRALinear(
                    getattr(parent, attribute), [rows for _, rows in parts], self.rows, max_loras, max_rank, param.device
                )
                setattr(parent, attribute, linear)
                self._linears.append(linear)
                for part, (name, _) in enumerate(parts):
                    self.targets[f"model.layers.{index}.{name}"] = (linear, part)
        self._slot_of: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return list(self._slot_of)

    def slot_of(self, name: str) -> int:
        return self._slot_of[name]

    def load(self, name: str, adapter: PeftAdapter) -> int:
        """Copy the adapter into a free slot; ValueError, with nothing loaded, when it does not fit
        this model or no slot is free."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {name} has rank {adapter.rank}, above --max-lora-rank {self.max_rank}")
        unknown = sorted(set(adapter.weights) - set(self.targets))
        if unknown:
            raise ValueError(f"adapter {name} targets modules this model has no adaptable linear for: {unknown[:3]}")
        by_linear: dict[LoRALinear, list] = {}
        for module, (a, b) in adapter.weights.items():
            linear, part = self.targets[module]
            if a.shape[1] != linear.in_features or b.shape[0] != linear.parts[part]:
                raise ValueError(f"adapter {name}: {module} has shapes {tuple(a.shape)}, {tuple(b.shape)}, not this model's")
            by_linear.setdefault(linear, [None] * len(linear.parts))[part] = (a, b)
        free = next((slot for slot in range(self.max_loras) if slot not in self._slot_of.values()), None)
        if free is None:
            raise ValueError(f"all {self.max_loras} adapter slots are taken (--max-loras)")
        with torch.no_grad():
            for linear in self._linears:
                parts = by_linear.get(linear)
                if parts is None:
                    linear.clear(free)
                else:
                    linear.set_adapter(free, parts, adapter.scale)
        self._slot_of[name] = free
        return free

    def unload(self, name: str) -> None:
        slot = self._slot_of.pop(name)
        with torch.no_grad():
            for linear in self._linears:
                linear.clear(slot)
