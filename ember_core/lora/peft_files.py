"""A PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`), by path or from the
Hub: its rank, its scale (alpha / r, or alpha / sqrt(r) with rsLoRA) and each target module's A and B."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from ember_core.lora.weights import AdapterWeights

_PREFIX = "base_model.model."
# PEFT saves an adapted head's own weight beside its A and B (save_embedding_layers): the base
# model's, unless the vocabulary was resized, which then shows in B's rows. Skipped, as llama.cpp's
# convert_lora_to_gguf.py skips it.
_BASE_LAYER = ".base_layer.weight"


def _local_dir(path: str) -> Path:
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if path.startswith(("/", "./", "../", "~")):
        raise ValueError(f"adapter path {local} does not exist (expected a PEFT checkpoint's directory)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["adapter_config.json", "adapter_model.safetensors"]))


def _config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder} has no adapter_config.json: not a PEFT checkpoint") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{folder}/adapter_config.json is not JSON: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder} is a {config['peft_type']} adapter; ember serves LoRA")
    # fan_in_fan_out (GPT-2's Conv1D) transposes only the base weight: A and B are stored as usual.
    unsupported = {
        "use_dora": "DoRA", "rank_pattern": "a rank per module", "alpha_pattern": "an alpha per module",
        "modules_to_save": "fully trained modules (modules_to_save)",
    }  # fmt: skip
    for key, what in unsupported.items():
        if config.get(key):
            raise ValueError(f"adapter {folder.name}: {what} is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"adapter {folder.name}: trained biases are not supported")
    return config


def read_peft_adapter(path: str) -> AdapterWeights:
    folder = _local_dir(path)
    config = _config(folder)
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(folder / "adapter_model.safetensors")
    except FileNotFoundError:
        raise ValueError(f"{folder} has no adapter_model.safetensors") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key.endswith(_BASE_LAYER):
            continue
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"adapter {folder.name}: unexpected tensor {key!r}")
        pairs.setdefault(module, {})[kind[0]] = tensor
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
            raise ValueError(f"adapter {folder.name}: {module} needs lora_A [{rank}, in] and lora_B [out, {rank}]")
        weights[module] = (pair["A"], pair["B"])
    return AdapterWeights(rank, scale, weights)
