"""Where an adapter's files come from: a path on the engine's host or a Hugging Face Hub id, and
which of them a client may name at runtime (`--allow-runtime-lora-updating`, `--lora-dir`,
`--allow-lora-from-hub`). Adapters named at start (`--lora-modules`) are the operator's and load
from anywhere.

A refusal says the same whether the path exists or not, and never goes to the network: a client
learns nothing about the host from it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ember_core.lora.errors import AdapterError

OUTSIDE_THE_ROOTS = "lora_path must name an adapter inside a directory this server loads adapters from (--lora-dir)"
HUB_AT_RUNTIME_OFF = "lora_path is a Hugging Face Hub id: this server loads adapters from the Hub only with --allow-lora-from-hub"


@dataclass(frozen=True)
class AdapterSource:
    path: str  # as given: a local path, or a Hub id ("owner/repo", or "owner/repo/file.gguf")
    from_hub: bool


def is_local_path(path: str) -> bool:
    """A path names the host's files when it starts like one; anything else is a Hub id (a relative
    directory of that name is the host's too, when it exists: the operator's --lora-modules only)."""
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists()


@dataclass(frozen=True)
class RuntimeAdapterPolicy:
    """What a LoadAdapter from a gateway may name."""

    roots: tuple[str, ...] = ()  # --lora-dir: a runtime path must resolve inside one
    allow_hub: bool = False  # --allow-lora-from-hub

    def source(self, path: str) -> AdapterSource:
        """The source a runtime load reads; AdapterError (OUTSIDE_THE_ROOTS or HUB_AT_RUNTIME_OFF)
        for one it may not. Only absolute paths are local here: a relative one would depend on the
        engine's working directory."""
        if path.startswith(("/", "~")):
            if not self._inside_a_root(path):
                raise AdapterError(OUTSIDE_THE_ROOTS)
            return AdapterSource(path, from_hub=False)
        if path.startswith(".") or "\\" in path or not _looks_like_a_hub_id(path):
            raise AdapterError(OUTSIDE_THE_ROOTS)
        if not self.allow_hub:
            raise AdapterError(HUB_AT_RUNTIME_OFF)
        return AdapterSource(path, from_hub=True)

    def _inside_a_root(self, path: str) -> bool:
        # realpath follows every symlink and collapses "..": a link inside a root to outside is outside
        resolved = Path(os.path.realpath(os.path.expanduser(path)))
        for root in self.roots:
            allowed = Path(os.path.realpath(os.path.expanduser(root)))
            if resolved == allowed or allowed in resolved.parents:
                return True
        return False


def _looks_like_a_hub_id(path: str) -> bool:
    """owner/repo, or owner/repo/path/to/file.gguf: no empty, "." or ".." part."""
    parts = path.split("/")
    shape_fits = len(parts) == 2 or (len(parts) > 2 and path.endswith(".gguf"))
    return shape_fits and all(part and part not in (".", "..") for part in parts)
