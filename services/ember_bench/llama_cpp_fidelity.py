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
from pathlib import Path

from ember_bench.fidelity import Fidelity
from ember_bench.stats import Distribution

_ATTEMPTS = 3
_NUMBER = r"(-?[\d.]+)"
_FIGURES = {  # what -> the line of llama-perplexity's output that holds it
    "windows": r"computing over (\d+) chunks, n_ctx=(\d+)",
    "kl_mean": rf"Mean\s+KLD:\s+{_NUMBER}\s+±\s+{_NUMBER}",
    "kl_median": rf"Median\s+KLD:\s+{_NUMBER}",
    "kl_p99": rf"99\.0%\s+KLD:\s+{_NUMBER}",
    "kl_max": rf"Maximum KLD:\s+{_NUMBER}",
    "top1": rf"Same top p:\s+{_NUMBER}\s+±\s+{_NUMBER}",
    "reference_perplexity": rf"Mean PPL\(base\)\s+:\s+{_NUMBER}",
    "perplexity": rf"Mean PPL\(Q\)\s+:\s+{_NUMBER}",
}


def parse_kl_statistics(output: str) -> Fidelity:
    found = {}
    for what, pattern in _FIGURES.items():
        match = re.search(pattern, output)
        if match is None:
            raise ValueError(f"llama-perplexity printed no {pattern!r} line; its output ends:\n{output[-2000:]}")
        found[what] = [float(group) for group in match.groups()]
    (windows, context), (kl_mean, kl_mean_error), (top1, top1_error) = found["windows"], found["kl_mean"], found["top1"]
    return Fidelity(
        scored_tokens=int(windows) * (int(context) - 1 - int(context) // 2),
        kl=Distribution(kl_mean, found["kl_median"][0], found["kl_p99"][0]),
        kl_mean_error=kl_mean_error,
        kl_max=found["kl_max"][0],
        top1_agreement=top1 / 100,
        top1_error=top1_error / 100,
        reference_perplexity=found["reference_perplexity"][0],
        perplexity=found["perplexity"][0],
    )


def llama_cpp_fidelity(
    bin_dir: Path, model: Path, text: Path, context: int, threads: int, workdir: Path, max_windows: int | None = None,
    kv_cache_q8_0: bool = False,
) -> Fidelity:
    """llama.cpp's arithmetic on the file against float32 weights; with kv_cache_q8_0, its q8_0 K/V
    cache against its float16 one on the file's own weights (flash attention on in both: llama.cpp
    quantizes V only there)."""
    base = workdir / "base.kld"
    common = ["-c", str(context), "-t", str(threads), "--kl-divergence-base", base]
    if max_windows is not None:
        common += ["--chunks", str(max_windows)]
    tested = []
    if kv_cache_q8_0:
        reference = model
        common += ["-fa", "on"]
        tested = ["-ctk", "q8_0", "-ctv", "q8_0"]
    else:
        reference = workdir / "float32.gguf"
        _run([bin_dir / "llama-quantize", "--allow-requantize", model, reference, "F32"])
    _run([bin_dir / "llama-perplexity", "-m", reference, "-f", text, *common])
    argv = [bin_dir / "llama-perplexity", "-m", model, *common, *tested, "--kl-divergence"]
    for _ in range(_ATTEMPTS):
        # llama.cpp logs from a background thread and may exit before it wrote the statistics
        # (seen here about one run in three on a small model): run it again then.
        output = _run(argv)
        if all(re.search(pattern, output) for pattern in _FIGURES.values()):
            break
    return parse_kl_statistics(output)


def _run(argv: list[object]) -> str:
    done = subprocess.run([str(arg) for arg in argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(str(argv[0])).name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr
