"""The adapters an engine serves, and the max_loras slots of the model's linears they run from: the
linears the model names (its adapter_targets: attention and MLP) are wrapped in LoRALinears once, at
engine start, the output head when an adapter first adapts it. A loaded adapter is
checked against the model and kept (in CPU memory); it takes a slot when a request of it is
admitted, the least recently used slot no running request holds giving way (LRU), and a request
whose adapter finds every slot held waits in the queue until one is released.

A checkpoint's module name maps to a linear of ember's model and a part of it: q_proj, k_proj and
v_proj are the parts of ember's fused qkv_proj, gate_proj and up_proj of gate_up_proj, as the base
weights' shards are (Decoder.fused_shards)."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from ember_core.config import LoRADtype
from ember_core.engine.sequence import Sequence
from ember_core.layers.lora import AdapterRows, AdapterTarget, LoRALinear
from ember_core.lora.errors import AdapterError
from ember_core.lora.weights import AdapterWeights
from ember_core.models.decoder import Decoder
from ember_core.models.decoder_config import DecoderConfig
from ember_core.models.gpt2 import GPT2
from ember_core.models.gpt2_config import GPT2Config

_HEAD = "lm_head"


class AdapterSlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, lora_dtype: LoRADtype = "auto") -> None:
        if not isinstance(model, Decoder | GPT2):
            raise ValueError(f"LoRA adapters are not supported for {type(model).__name__} models")  # noqa: TRY004 -- a setting refused
        self.config: DecoderConfig | GPT2Config = model.config  # what an adapter's file is read against
        param = next(model.parameters())
        self._dtype = param.dtype if lora_dtype == "auto" else getattr(torch, lora_dtype)  # the A and B stacks'
        self._device = param.device
        self.rows = AdapterRows(max_loras)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets: dict[str, tuple[LoRALinear, int]] = {}  # checkpoint module name -> (linear, part)
        self._linears: list[LoRALinear] = []
        for target in model.adapter_targets():
            self._wrap(target)
        self._model = model  # its head is wrapped when an adapter first adapts it (_wrap_head)
        self._adapters: dict[str, tuple[AdapterWeights, dict[LoRALinear, list]]] = {}  # name -> (adapter, its parts)
        self._slot_of: dict[str, int] = {}  # adapters in a slot
        self._holders = [0] * max_loras  # per slot, the admitted requests running with it
        self._last_used = [0] * max_loras  # per slot, when a request last took it (a counter)
        self._clock = itertools.count(1)

    def _wrap(self, target: AdapterTarget) -> None:
        linear = LoRALinear(
            getattr(target.parent, target.attribute), [rows for _, rows in target.parts], self.rows, self.max_loras,
            self.max_rank, self._dtype, self._device,
        )
        setattr(target.parent, target.attribute, linear)
        self._linears.append(linear)
        for part, (name, _) in enumerate(target.parts):
            self.targets[name] = (linear, part)

    def _wrap_head(self) -> None:
        """The output head's slots, made only once an adapter needs them: B^T is vocabulary x rank x
        max_loras values, as large as the linears of a few layers. Its slots start empty, as every
        adapter loaded before leaves the head."""
        self._wrap(AdapterTarget(self._model, _HEAD, [(_HEAD, self._model.lm_head.out_features)]))

    @property
    def names(self) -> list[str]:
        """The adapters loaded, in a slot or not."""
        return list(self._adapters)

    def load(self, name: str, adapter: AdapterWeights) -> None:
        """Keep the adapter, in a free slot if there is one; ValueError, with nothing loaded, when it
        does not fit this model."""
        if adapter.rank > self.max_rank:
            raise AdapterError(f"adapter {name} has rank {adapter.rank}, above --max-lora-rank {self.max_rank}")
        if _HEAD in adapter.weights and _HEAD not in self.targets:
            self._wrap_head()
        unknown = sorted(set(adapter.weights) - set(self.targets))
        if unknown:
            raise AdapterError(f"adapter {name} targets modules this model has no adaptable linear for: {unknown[:3]}")
        by_linear: dict[LoRALinear, list] = {}
        for module, (a, b) in adapter.weights.items():
            linear, part = self.targets[module]
            if a.shape[1] != linear.in_features or b.shape[0] != linear.parts[part]:
                raise AdapterError(f"adapter {name}: {module} has shapes {tuple(a.shape)}, {tuple(b.shape)}, not this model's")
            by_linear.setdefault(linear, [None] * len(linear.parts))[part] = (a, b)
        self._adapters[name] = (adapter, by_linear)
        free = self._free_slot()
        if free is not None:
            self._install(name, free)

    def unload(self, name: str) -> None:
        """Forget the adapter; the caller checks that no request of it is in flight."""
        del self._adapters[name]
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._clear(slot)

    def acquire(self, seq: Sequence) -> bool:
        """Give an admitted request its adapter's slot (seq.adapter_slot); False, taking nothing,
        when every slot is held by running requests of other adapters."""
        slot = self._slot_of.get(seq.adapter)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                idle = [s for s in range(self.max_loras) if not self._holders[s]]
                if not idle:
                    return False
                slot = min(idle, key=lambda s: self._last_used[s])
                evicted = next(name for name, held in self._slot_of.items() if held == slot)
                del self._slot_of[evicted]
            self._install(seq.adapter, slot)
        self._holders[slot] += 1
        self._last_used[slot] = next(self._clock)
        seq.adapter_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        """The request no longer runs (finished, aborted or preempted): its slot may give way."""
        if seq.adapter_slot >= 0:
            self._holders[seq.adapter_slot] -= 1
            seq.adapter_slot = -1

    def _free_slot(self) -> int | None:
        taken = set(self._slot_of.values())
        return next((slot for slot in range(self.max_loras) if slot not in taken), None)

    def _install(self, name: str, slot: int) -> None:
        adapter, by_linear = self._adapters[name]
        with torch.no_grad():
            for linear in self._linears:
                parts = by_linear.get(linear)
                if parts is None:
                    linear.clear(slot)
                else:
                    linear.set_adapter(slot, parts)
        self.rows.scales[slot] = adapter.scale
        self._slot_of[name] = slot

    def _clear(self, slot: int) -> None:
        with torch.no_grad():
            for linear in self._linears:
                linear.clear(slot)

