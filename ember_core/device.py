"""Device and dtype selection."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if resolved.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {device!r} is not supported: use auto, cpu, cuda or mps")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} requested but there are {torch.cuda.device_count()} CUDA devices")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' requested but MPS is not available")
    return resolved


def available_memory(
    device: torch.device, meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes a new allocation on device can take, where that can be told: CUDA's free memory; on
    Linux, MemAvailable, or less under a cgroup (v2) memory limit, as in a container: the limit less
    the cgroup's anonymous memory (its page cache, the mapped weights included, can be reclaimed)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
    except OSError:
        return None
    if found is None:
        return None
    available = int(found.group(1)) * 1024
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        anonymous = re.search(r"^anon (\d+)$", (cgroup / "memory.stat").read_text(), re.MULTILINE)
    except OSError:
        return available
    if limit == "max" or anonymous is None:
        return available
    return min(available, int(limit) - int(anonymous.group(1)))


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.float16
        raise ValueError("dtype auto on a CPU follows the model's numerics and weights: ember_core.auto_dtype decides it")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
