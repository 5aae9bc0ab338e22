"""llama.cpp's own figure for `ember bench fidelity`: its arithmetic on a quantized file against its
float32 computation on the same weights, from its own tools (a build's bin directory):

    llama-quantize --allow-requantize FILE f32.gguf F32          # the blocks widened, as ember's exact
    llama-perplexity -m f32.gguf -f TEXT -c N --kl-divergence-base base.kld
    llama-perplexity -m FILE -c N --kl-divergence-base base.kld --kl-divergence

Both runs keep llama.cpp's default float16 K/V cache, so the difference is its linears' arithmetic.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LlamaCppFidelity:
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    reference_perplexity: float
    perplexity: float


_ATTEMPTS = 3
_FIGURES = {  # field -> the line of llama-perplexity's statistics that holds it
    "kl_mean": r"Mean\s+KLD:\s+(-?[\d.]+)",
    "kl_p99": r"99\.0%\s+KLD:\s+(-?[\d.]+)",
    "kl_max": r"Maximum KLD:\s+(-?[\d.]+)",
    "top1_agreement": r"Same top p:\s+([\d.]+)",
    "reference_perplexity": r"Mean PPL\(base\)\s+:\s+([\d.]+)",
    "perplexity": r"Mean PPL\(Q\)\s+:\s+([\d.]+)",
}


def parse_kl_statistics(output: str) -> LlamaCppFidelity:
    figures = {}
    for field, pattern in _FIGURES.items():
        match = re.search(pattern, output)
        if match is None:
            raise ValueError(f"llama-perplexity printed no {pattern!r} line; its output ends:\n{output[-2000:]}")
        figures[field] = float(match.group(1))
    figures["top1_agreement"] /= 100
    return LlamaCppFidelity(**figures)


def llama_cpp_fidelity(
    bin_dir: Path, model: Path, text: Path, context: int, threads: int, workdir: Path, max_windows: int | None = None
) -> LlamaCppFidelity:
    float32, base = workdir / "float32.gguf", workdir / "base.kld"
    _run([bin_dir / "llama-quantize", "--allow-requantize", model, float32, "F32"])
    common = ["-c", str(context), "-t", str(threads), "--kl-divergence-base", base]
    if max_windows is not None:
        common += ["--chunks", str(max_windows)]
    _run([bin_dir / "llama-perplexity", "-m", float32, "-f", text, *common])
    argv = [bin_dir / "llama-perplexity", "-m", model, *common, "--kl-divergence"]
    for _ in range(_ATTEMPTS):
        # llama.cpp logs from a background thread and may exit before it wrote the statistics
        # (seen here about one run in three on a small model): run it again then.
        output = _run(argv)
        if re.search(_FIGURES["kl_mean"], output):
            break
    return parse_kl_statistics(output)


def _run(argv: list[object]) -> str:
    done = subprocess.run([str(arg) for arg in argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(str(argv[0])).name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr
