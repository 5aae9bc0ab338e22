"""Hugging Face checkpoints: config.json plus safetensors (single or sharded) or pytorch_model.bin."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

WEIGHT_PATTERNS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def read_hf_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    return _read_json(config_path)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")  # noqa: TRY004 - bad file content
    return value


def _weight_files(model_dir: Path) -> list[Path]:
    for single, index in (("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (model_dir / single).is_file():
            return [model_dir / single]
        if (model_dir / index).is_file():
            weight_map = _read_json(model_dir / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{model_dir / index} has no weight_map object")
            shards = sorted(set(weight_map.values()))
            return [model_dir / shard for shard in shards]
    raise ValueError(f"{model_dir} has no weights: expected one of {', '.join(WEIGHT_PATTERNS)}")


# (checkpoint name, the tensor or a safetensors slice of it) -> the part of it to load
Take = Callable[[str, Any], torch.Tensor]


def iter_hf_weights(model_dir: Path, take: Take | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor by name; with `take` (a tensor-parallel rank's), only the part it
    takes, read from the safetensors file alone."""
    for path in _weight_files(model_dir):
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                        yield name, f.get_tensor(name) if take is None else take(name, f.get_slice(name))
            except SafetensorError as exc:  # a truncated or corrupt file
                raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
            yield from ((name, tensor if take is None else take(name, tensor)) for name, tensor in tensors.items())
