"""Linear-layer candidates timed on SmolLM2-135M shapes: `python -m ember_bench.kernel_linear`.

A step is the 120 layer matmuls (fused QKV, O, gate+up, down for 30 layers) plus the 49152 x 576
LM head, each layer with its own weights, so they stream from memory as in a real decode step.
The GGUF candidate keeps the layers in Q4_1 blocks and the head in Q8_0, as the packaged
SmolLM2 file stores them (random weights quantized with gguf-py here); the BF16 candidate keeps
bfloat16 rows, as a bf16 checkpoint loaded in float32 runs.
Candidates run in rotation inside every repeat so that load from other processes hits them all
alike; the median and the best step are printed per batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import gguf
import torch
import torch.nn.functional as F

from ember_core.kernels import cpu_ops
from ember_core.layers.linear import GGUF_BLOCK_FORMATS

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
LAYER_SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]

LinearFn = Callable[[torch.Tensor, Any], torch.Tensor]


def candidates() -> dict[str, tuple[LinearFn, Callable[[torch.Tensor], Any]]]:
    """name -> (linear(x, prepared weight), prepare(weight))."""
    found: dict[str, tuple[LinearFn, Callable[[torch.Tensor], Any]]] = {
        "F.linear (BLAS sgemm)": (F.linear, lambda w: w),
    }
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        found["oneDNN, weights packed once"] = (
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
        )
    if cpu_ops.is_available():
        found["ember small_batch_linear"] = (
            lambda x, w: cpu_ops.ops().small_batch_linear(x, w, None),
            lambda w: w,
        )
        found["ember gguf_block_linear (Q4_1 layers, Q8_0 head)"] = (
            _block_linear,
            _quantize_like_smollm2,
        )
        found["ember gguf_block_linear (BF16 rows)"] = (
            _block_linear,
            lambda w: (w.bfloat16().view(torch.uint8), GGUF_BLOCK_FORMATS[gguf.GGMLQuantizationType.BF16]),
        )
    return found


def _block_linear(x: torch.Tensor, packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    return cpu_ops.ops().gguf_block_linear(x, packed[0], None, packed[1], x.shape[1])


def _quantize_like_smollm2(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    kind = gguf.GGMLQuantizationType.Q8_0 if weight.shape[0] == VOCAB else gguf.GGMLQuantizationType.Q4_1
    return torch.from_numpy(gguf.quants.quantize(weight.numpy(), kind)), GGUF_BLOCK_FORMATS[kind]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(shape, generator=generator) * 0.05 for shape in shapes]
    fns = candidates()
    prepared = {name: [prepare(w) for w in weights] for name, (_, prepare) in fns.items()}
    print(f"torch {torch.__version__}, {args.threads} threads; ms per step (median / best of {args.repeats})")
    with torch.inference_mode():
        for batch in args.batches:
            inputs = {k: torch.randn(batch, k, generator=generator) for k in (HIDDEN, INTERMEDIATE)}
            times: dict[str, list[float]] = {name: [] for name in fns}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for name, (linear, _) in fns.items():
                    start = time.perf_counter()
                    for (_, in_features), weight in zip(shapes, prepared[name]):
                        linear(inputs[in_features], weight)
                    if repeat:
                        times[name].append((time.perf_counter() - start) * 1e3)
            row = "  ".join(f"{name}: {statistics.median(t):6.1f} / {min(t):6.1f}" for name, t in times.items())
            print(f"batch {batch:4d}  {row}", flush=True)


if __name__ == "__main__":
    main()
