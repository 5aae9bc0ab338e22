"""Loader for ember's C++ CPU ops, one extension per instruction set built from the .cpp files next
to this one: `paged_decode_attention` and `paged_decode_attention_supports` (paged_decode.cpp),
`small_batch_linear`, `gguf_block_linear` and `gguf_dequantize` (small_batch_linear.cpp),
`bf16_linear` (bf16_linear.cpp), `rms_norm`, `rms_norm_`, `rotary_`, `silu_and_mul`, `gelu_tanh_and_mul` and `sigmoid_mul`
(elementwise.cpp), `write_kv_cache_` (kv_cache.cpp),
`decoder_layer_` (decoder_layer.cpp), which chains them through their C++ declarations (ops.h), as
`moe_experts` (moe_experts.cpp) does for a mixture of experts,
the sampler's `inverse_cdf_draw` (sampling.cpp), `lora_add_` (lora.cpp), each row's LoRA delta by its
adapter's slot, `gated_delta_net` (gated_delta_net.cpp), `short_conv` (short_conv.cpp) and `mamba2` (mamba2.cpp), hybrid
models' recurrent layers between their projections, and `peak_loop` (peak.cpp), the arithmetic peak's
register-only loop. `ops()` is the op namespace of the instruction
set in use: `ops().small_batch_linear(...)`.

Each instruction set is built with fixed compiler flags (never `-march=native`, whose tuning and
contraction choices differ from CPU to CPU) and `-ffp-contract=off`: a multiply-add is fused where
the source says so (`multiply_add`, `_mm*_fmadd_ps`, `std::fma`) and nowhere else, so the bits
depend on the instruction set only. The best one the CPU runs is used, or the one `EMBER_CPU_ISA`
names (`baseline`, `avx2`, `avx512`, `avx512bf16`, `amx`), which lets a machine run and test the
lower paths.

The build is attempted once per process and instruction set; a failure (no compiler, no ninja, ...)
is remembered, so callers can ask `is_available()` once and fall back to SDPA / torch's GEMM
without paying for a retry per call.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_decode.cpp", "small_batch_linear.cpp", "bf16_linear.cpp", "elementwise.cpp", "kv_cache.cpp",
        "decoder_layer.cpp", "moe_experts.cpp", "sampling.cpp", "peak.cpp", "int8_linear.cpp", "lora.cpp",
        "gated_delta_net.cpp", "short_conv.cpp", "mamba2.cpp",
    )
]
_COMMON_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden")
ISA_ENVIRONMENT_VARIABLE = "EMBER_CPU_ISA"
NO_KERNELS = "torch"  # build_in_use() where the extension is unavailable: torch's own ops run

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)  # one instance each (INSTRUCTION_SETS): hashed by identity, cheaply per op call
class InstructionSet:
    name: str
    cpu_flags: tuple[str, ...]  # what /proc/cpuinfo must list for the build to run here
    compiler_flags: tuple[str, ...]

    @property
    def op_namespace(self) -> str:
        return f"ember_{self.name}"

    def missing_cpu_flags(self) -> list[str]:
        return [flag for flag in self.cpu_flags if flag not in cpu_flags()]


# x86-64-v3 and -v4 as GCC and Clang define them; `abm` is how Linux names LZCNT.
_X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_X86_64_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_IS_X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# Lowest first. `baseline` is the generic vector code every CPU of the architecture runs.
INSTRUCTION_SETS = (
    InstructionSet("baseline", (), ("-mtune=generic",) if _IS_X86_64 else ()),
    *(
        (
            InstructionSet("avx2", _X86_64_V3, ("-march=x86-64-v3", "-mtune=generic")),
            InstructionSet("avx512", (*_X86_64_V3, *_X86_64_V4, "avx512_vnni"), ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic")),
            InstructionSet(
                "avx512bf16", (*_X86_64_V3, *_X86_64_V4, "avx512_vnni", "avx512_bf16"),
                ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=generic"),
            ),
            InstructionSet(
                "amx", (*_X86_64_V3, *_X86_64_V4, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"),
                ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mtune=generic"),
            ),
        )
        if _IS_X86_64
        else ()
    ),
)


class KernelUnavailableError(RuntimeError):
    """The C++ extension could not be built or loaded on this machine."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo lists for this CPU (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def instruction_set_named(name: str) -> InstructionSet:
    """The instruction set called `name`; ValueError naming the choices or the CPU flags it lacks."""
    by_name = {isa.name: isa for isa in INSTRUCTION_SETS}
    if name not in by_name:
        raise ValueError(f"{ISA_ENVIRONMENT_VARIABLE}={name!r}: expected one of {', '.join(by_name)}")
    missing = by_name[name].missing_cpu_flags()
    if missing:
        raise ValueError(f"{ISA_ENVIRONMENT_VARIABLE}={name!r}: this CPU lacks {', '.join(missing)}")
    return by_name[name]


def runnable_instruction_sets() -> list[InstructionSet]:
    """The instruction sets this CPU runs, lowest first."""
    return [isa for isa in INSTRUCTION_SETS if not isa.missing_cpu_flags()]


@functools.cache
def _chosen_instruction_set() -> InstructionSet:
    name = os.environ.get(ISA_ENVIRONMENT_VARIABLE, "").strip().lower()
    return instruction_set_named(name) if name else runnable_instruction_sets()[-1]


_active: InstructionSet | None = None  # set by use_instruction_set(); else the chosen one


def active_instruction_set() -> InstructionSet:
    """The instruction set whose build the ops run: EMBER_CPU_ISA's, else the best this CPU runs."""
    return _active or _chosen_instruction_set()


def use_instruction_set(isa: InstructionSet | None) -> None:
    """Run the ops of `isa` from now on in this process (None: back to the chosen one); for tests
    and benchmarks that compare the paths."""
    global _active
    _active = isa


def _build_tag(isa: InstructionSet) -> str:
    # The binary depends on the flags, the Python and torch it is built for, and where the sources
    # are: two checkouts sharing one name would rebuild over each other's binary at every start.
    key = f"{isa.compiler_flags}\n{_COMMON_FLAGS}\n{sys.version_info[:2]}\n{torch.__version__}\n{Path(__file__).parent.resolve()}"
    return hashlib.sha1(key.encode()).hexdigest()[:10]


def build_directory(isa: InstructionSet | None = None) -> Path:
    """Where an instruction set's extension is built and cached: under TORCH_EXTENSIONS_DIR or
    torch's default root."""
    from torch.utils import cpp_extension

    isa = isa or active_instruction_set()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"ember_cpu_ops_{isa.name}_{_build_tag(isa)}"


def _put_venv_ninja_on_path() -> None:
    # cpp_extension runs `ninja` from PATH; pip installs it next to the interpreter, which is not on
    # PATH when the venv's python is run without activating the venv (as `make test` does).
    interpreter_dir = Path(sys.executable).parent
    if shutil.which("ninja") is None and (interpreter_dir / "ninja").exists():
        os.environ["PATH"] = f"{interpreter_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _build(isa: InstructionSet) -> None:
    import fcntl

    from torch.utils import cpp_extension

    _put_venv_ninja_on_path()
    directory = build_directory(isa)
    directory.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a file, which a build killed midway (a Ctrl-C at the first start)
    # leaves behind, and every later load then waits on it forever. An OS lock dies with its
    # process: whoever holds it knows no other ember process is building, so such a file is stale.
    with open(directory / "ember-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        library = directory / f"{directory.name}.so"
        built_before = library.stat().st_mtime_ns if library.exists() else None
        started = time.monotonic()
        cpp_extension.load(
            name=directory.name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=[*_COMMON_FLAGS, *isa.compiler_flags, f"-DEMBER_OPS={isa.op_namespace}"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )
    if built_before is not None and library.stat().st_mtime_ns == built_before:
        logger.info("CPU kernels: the %s build loaded from %s", isa.name, directory)
    else:
        logger.info("CPU kernels: compiled the %s build in %.0f s into %s", isa.name, time.monotonic() - started, directory)


def _fake(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    return torch.empty_like(query)


@functools.cache
def _load(isa: InstructionSet) -> Exception | None:
    try:
        _build(isa)
        torch.library.register_fake(f"{isa.op_namespace}::paged_decode_attention")(_fake)
    except Exception as error:  # noqa: BLE001 - any build or load failure means "use the fallback"
        return error
    return None


def is_available() -> bool:
    """Build the active instruction set's extension on first call; True when its ops can be used in
    this process. An EMBER_CPU_ISA this CPU cannot run is a ValueError, not a quiet fallback."""
    return _load(active_instruction_set()) is None


def build_in_use() -> str:
    """The name of the build the ops run (an instruction set's), or NO_KERNELS where it cannot be
    built: what a CPU model's bits depend on besides its settings."""
    return active_instruction_set().name if is_available() else NO_KERNELS


def unavailable_reason() -> str | None:
    """Why the extension could not be built or loaded (None when it is available)."""
    error = _load(active_instruction_set())
    return None if error is None else f"{type(error).__name__}: {error}"


def ops() -> torch._ops._OpNamespace:
    """The ops of the active instruction set (torch.ops.ember_<name>); raises KernelUnavailableError
    when its extension could not be built."""
    isa = active_instruction_set()
    error = _load(isa)
    if error is not None:
        raise KernelUnavailableError(f"ember's C++ CPU ops could not be built: {unavailable_reason()}") from error
    return getattr(torch.ops, isa.op_namespace)


def decode_attention_supports(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether `paged_decode_attention` is built for this query / KV cache dtype pair (asks the
    kernel, so the list lives in paged_decode.cpp only); False without the extension."""
    return is_available() and ops().paged_decode_attention_supports(query_dtype, cache_dtype)


def paged_decode_attention(
    query: torch.Tensor,  # [batch, num_heads, head_dim], contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    context_lens: torch.Tensor,  # [batch] int32; 0 gives a zero output row
    scale: float,
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
    window: int = 0,  # > 0: each query sees only the last `window` positions (sliding-window layers)
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V; returns [batch, num_heads, head_dim]."""
    return ops().paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, softcap, window)
