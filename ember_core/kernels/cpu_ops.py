"""Loader for ember's C++ CPU ops, one extension built from the .cpp files next to this one:
`torch.ops.ember.paged_decode_attention` and `paged_decode_attention_supports` (paged_decode.cpp),
`small_batch_linear`, `gguf_block_linear` and `gguf_dequantize` (small_batch_linear.cpp),
`rms_norm`, `rotary_` and `silu_and_mul` (elementwise.cpp), `write_kv_cache_` (kv_cache.cpp), and
`llama_decode_layer_` (decoder_layer.cpp), which chains them through their C++ declarations (ops.h),
and the sampler's `inverse_cdf_draw` (sampling.cpp).

The build is attempted once per process; a failure (no compiler, no ninja, ...) is remembered, so
callers can ask `is_available()` once and fall back to SDPA / torch's GEMM without paying for a
retry per call.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("paged_decode.cpp", "small_batch_linear.cpp", "elementwise.cpp", "kv_cache.cpp", "decoder_layer.cpp", "sampling.cpp")
]


class KernelUnavailableError(RuntimeError):
    """The C++ extension could not be built or loaded on this machine."""


def _build_tag() -> str:
    # Builds are cached by name. The build uses -march=native, so a home directory shared with a
    # machine of another CPU must not load this one's binary: the name carries the CPU's flags. It
    # also carries the Python and torch versions the binary is built for, and where the sources are:
    # two checkouts sharing one name would rebuild over each other's binary at every start.
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        flags = ""
    key = f"{flags or platform.processor()}\n{sys.version_info[:2]}\n{torch.__version__}\n{Path(__file__).parent.resolve()}"
    return hashlib.sha1(key.encode()).hexdigest()[:10]


def build_directory() -> Path:
    """Where the extension is built and cached: under TORCH_EXTENSIONS_DIR or torch's default root."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"ember_cpu_ops_{_build_tag()}"


def _put_venv_ninja_on_path() -> None:
    # cpp_extension runs `ninja` from PATH; pip installs it next to the interpreter, which is not on
    # PATH when the venv's python is run without activating the venv (as `make test` does).
    interpreter_dir = Path(sys.executable).parent
    if shutil.which("ninja") is None and (interpreter_dir / "ninja").exists():
        os.environ["PATH"] = f"{interpreter_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _build() -> None:
    import fcntl

    from torch.utils import cpp_extension

    _put_venv_ninja_on_path()
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a file, which a build killed midway (a Ctrl-C at the first start)
    # leaves behind, and every later load then waits on it forever. An OS lock dies with its
    # process: whoever holds it knows no other ember process is building, so such a file is stale.
    with open(directory / "ember-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=directory.name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )


def _fake(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(query)


@functools.cache
def _load() -> Exception | None:
    try:
        _build()
        torch.library.register_fake("ember::paged_decode_attention")(_fake)
    except Exception as error:  # noqa: BLE001 - any build or load failure means "use the fallback"
        return error
    return None


def is_available() -> bool:
    """Build the extension on first call; True when the op can be used in this process."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the extension could not be built or loaded (None when it is available)."""
    error = _load()
    return None if error is None else f"{type(error).__name__}: {error}"


def decode_attention_supports(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether `paged_decode_attention` is built for this query / KV cache dtype pair (asks the
    kernel, so the list lives in paged_decode.cpp only); False without the extension."""
    return is_available() and torch.ops.ember.paged_decode_attention_supports(query_dtype, cache_dtype)


def paged_decode_attention(
    query: torch.Tensor,  # [batch, num_heads, head_dim], contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    context_lens: torch.Tensor,  # [batch] int32; 0 gives a zero output row
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V; returns [batch, num_heads, head_dim]."""
    error = _load()
    if error is not None:
        raise KernelUnavailableError(
            f"ember's C++ CPU ops could not be built: {unavailable_reason()}"
        ) from error
    return torch.ops.ember.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
