"""A PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`), by path or from the
Hub: its rank, its scale (alpha / r, or alpha / sqrt(r) with rsLoRA) and each target module's A and B."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from ember_core.lora.errors import AdapterError
from ember_core.lora.sources import AdapterSource
from ember_core.lora.weights import AdapterWeights

logger = logging.getLogger(__name__)

_PREFIX = "base_model.model."
# PEFT saves an adapted head's own weight beside its A and B (save_embedding_layers): the base
# model's, unless the vocabulary was resized, which then shows in B's rows. Skipped, as llama.cpp's
# convert_lora_to_gguf.py skips it.
_BASE_LAYER = ".base_layer.weight"


def _folder(source: AdapterSource) -> Path:
    if not source.from_hub:
        local = Path(source.path).expanduser()
        if not local.is_dir():
            problem = "is not a directory" if local.exists() else "does not exist"
            raise AdapterError(f"{source.path} {problem} (expected a PEFT checkpoint's directory)")
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source.path, allow_patterns=["adapter_config.json", "adapter_model.safetensors"]))
    except Exception as exc:
        logger.warning("fetching adapter %s from the Hugging Face Hub failed: %s: %s", source.path, type(exc).__name__, exc)
        raise AdapterError(f"{source.path} could not be fetched from the Hugging Face Hub") from exc


def _config(folder: Path, label: str) -> dict:
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterError(f"{label} has no adapter_config.json: not a PEFT checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise AdapterError(f"{label}: adapter_config.json is not JSON") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), int | float):
        raise AdapterError(f"{label}: adapter_config.json has no integer r and numeric lora_alpha")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{label} is a {config['peft_type']} adapter; ember serves LoRA")
    # fan_in_fan_out (GPT-2's Conv1D) transposes only the base weight: A and B are stored as usual.
    unsupported = {
        "use_dora": "DoRA", "rank_pattern": "a rank per module", "alpha_pattern": "an alpha per module",
        "modules_to_save": "fully trained modules (modules_to_save)",
    }  # fmt: skip
    for key, what in unsupported.items():
        if config.get(key):
            raise AdapterError(f"{label}: {what} is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError(f"{label}: trained biases are not supported")
    return config


def read_peft_adapter(source: AdapterSource) -> AdapterWeights:
    folder, label = _folder(source), source.path
    config = _config(folder, label)
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    if rank < 1:
        raise AdapterError(f"{label}: rank r must be at least 1, got {rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(folder / "adapter_model.safetensors")
    except FileNotFoundError:
        raise AdapterError(f"{label} has no adapter_model.safetensors") from None
    except Exception as exc:
        logger.warning("adapter %s: adapter_model.safetensors unreadable: %s", label, exc)
        raise AdapterError(f"{label}: adapter_model.safetensors is not a readable safetensors file") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key.endswith(_BASE_LAYER):
            continue
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise AdapterError(f"{label}: unexpected tensor {key!r}")
        pairs.setdefault(module, {})[kind[0]] = tensor
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
            raise AdapterError(f"{label}: {module} needs lora_A [{rank}, in] and lora_B [out, {rank}]")
        weights[module] = (pair["A"], pair["B"])
    return AdapterWeights(rank, scale, weights)
