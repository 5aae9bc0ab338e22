"""Random PEFT LoRA adapters shaped for any model ember loads, a GGUF file included, for the LoRA
serving benchmarks (`ember bench make-adapter`): A and B drawn as a trained adapter's are sized, so
each one changes the model's text."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ember_core.loaders.load import load_model


def write_random_adapters(model: str, outs: list[Path], rank: int, targets: list[str], seed: int) -> None:
    """One adapter per directory in `outs`, seeds seed, seed + 1, ...; `targets` as PEFT's
    target_modules (q_proj, ..., down_proj, lm_head)."""
    loaded = load_model(model, torch.device("cpu"), torch.float32).model
    shapes = {
        name: (getattr(target.parent, target.attribute).in_features, rows)
        for target in loaded.adapter_targets()
        for name, rows in target.parts
        if name.rpartition(".")[2] in targets
    }
    if "lm_head" in targets:
        shapes["lm_head"] = (loaded.lm_head.in_features, loaded.lm_head.out_features)
    missing = set(targets) - {name.rpartition(".")[2] for name in shapes}
    if missing:
        raise ValueError(f"{model} has no {', '.join(sorted(missing))} to adapt")
    for index, out in enumerate(outs):
        generator = torch.Generator().manual_seed(seed + index)
        tensors = {}
        for name, (in_features, out_features) in shapes.items():
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.3 / rank**0.5
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, out / "adapter_model.safetensors")
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets, "base_model_name_or_path": model}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
