"""Which model class serves which HF `model_type`."""

from __future__ import annotations

from typing import Any

from torch import nn

from ember_core.models.gpt2 import GPT2, GPT2Config
from ember_core.models.llama import Llama, LlamaConfig

MODEL_TYPES: dict[str, tuple[Any, type[nn.Module]]] = {
    "gpt2": (GPT2Config, GPT2),
    "llama": (LlamaConfig, Llama),
}


def model_from_hf_config(hf_config: dict[str, Any]) -> nn.Module:
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; ember supports {sorted(MODEL_TYPES)}")
    config_cls, model_cls = MODEL_TYPES[model_type]
    return model_cls(config_cls.from_hf(hf_config))
