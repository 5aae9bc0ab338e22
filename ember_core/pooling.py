"""How a model's final hidden states pool into one embedding, as its files say: sentence-transformers'
`modules.json` and `1_Pooling/config.json`, Matryoshka sizes in `config.json`, or a GGUF file's
`<arch>.pooling_type`. Torch-free: the gateway checks `dimensions` with it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Pooling = Literal["last", "mean", "cls"]

# sentence-transformers' Pooling module flags, in the order vLLM reads them
_SENTENCE_TRANSFORMERS_FLAGS: dict[str, Pooling] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
# llama.cpp's enum llama_pooling_type: 1 mean, 2 cls, 3 last (0 none, 4 rank: not embeddings)
GGUF_POOLING_TYPES: dict[int, Pooling] = {1: "mean", 2: "cls", 3: "last"}
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_POOLING_MODULE = "sentence_transformers.models.Pooling"


@dataclass(frozen=True)
class PoolingConfig:
    # last: a decoder's default (vLLM's for decoder-only embedding models such as Qwen3-Embedding)
    method: Pooling = "last"
    normalize: bool = True  # L2; off only where modules.json lists no Normalize module
    # The sizes `dimensions` may truncate an embedding to (Matryoshka): () any up to the hidden size;
    # None: the model was not trained for truncation.
    matryoshka_dimensions: tuple[int, ...] | None = None


def read_pooling_config(model_dir: Path | None, hf_config: dict, gguf_pooling: Pooling | None = None) -> PoolingConfig:
    """model_dir: a Hugging Face directory (None for a GGUF file); hf_config: its config.json."""
    method, normalize = gguf_pooling or "last", True
    modules = _read_json(model_dir / "modules.json") if model_dir is not None else None
    if isinstance(modules, list):
        types = {module.get("type"): module.get("path", "") for module in modules if isinstance(module, dict)}
        normalize = _NORMALIZE_MODULE in types
        if _POOLING_MODULE in types:
            flags = _read_json(model_dir / types[_POOLING_MODULE] / "config.json") or {}
            method = next((pooling for flag, pooling in _SENTENCE_TRANSFORMERS_FLAGS.items() if flags.get(flag)), method)
    dimensions = hf_config.get("matryoshka_dimensions")
    matryoshka = tuple(dimensions) if dimensions else (() if hf_config.get("is_matryoshka") else None)
    return PoolingConfig(method, normalize, matryoshka)


def dimensions_error(dimensions: int, hidden_size: int, matryoshka_dimensions: tuple[int, ...] | list[int] | None) -> str | None:
    """Why an embedding of hidden_size values cannot be truncated to `dimensions`; None when it can."""
    if matryoshka_dimensions is None:
        return "this model does not support truncating its embeddings (it is not a Matryoshka model)"
    if matryoshka_dimensions:
        if dimensions not in matryoshka_dimensions:
            return f"dimensions must be one of {sorted(matryoshka_dimensions)}, got {dimensions}"
    elif not 1 <= dimensions <= hidden_size:
        return f"dimensions must be between 1 and the model's {hidden_size}, got {dimensions}"
    return None


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
