"""The arithmetic a model's linears run, `--numerics`:

- `exact`: the weights' values (a GGUF file's blocks widened as they are read) multiply the
  activations in the model's dtype, bit-identical to the dequantized weights' float computation.
- `fast`: activations are quantized to int8 per block of 32 values and multiply the blocks'
  integers with integer dot products (kernels/int8_linear.cpp), as llama.cpp computes a quantized
  file; a float checkpoint's weights are quantized to Q8_0 at load. Its distance from `exact` is
  measured (`ember bench fidelity`), not assumed.

Either way a request's output depends on its own tokens only, never on what shares its batch.
`auto` is `fast` for a file whose weights are already quantized (its user accepted quantization
error) and `exact` for float checkpoints.
"""

from __future__ import annotations

from typing import Literal

import torch

from ember_core.config import Numerics
from ember_core.kernels import cpu_ops

ResolvedNumerics = Literal["exact", "fast"]
INT8_DTYPES = (torch.float32, torch.bfloat16)  # the activations int8_linear quantizes


def resolve_numerics(
    requested: Numerics, quantized_weights: bool, device: torch.device, dtype: torch.dtype | Literal["auto"]
) -> ResolvedNumerics:
    """What `requested` means for a model whose file holds quantized weights (or not), on device in
    dtype (a dtype, or "auto": ember_core/auto_dtype.py's table, which gives fast float32);
    ValueError where fast cannot run."""
    problem = None
    if device.type != "cpu":
        problem = f"not on {device.type}"
    elif not cpu_ops.is_available():
        problem = f"they are unavailable: {cpu_ops.unavailable_reason()}"
    elif isinstance(dtype, torch.dtype) and dtype not in INT8_DTYPES:
        problem = f"which take float32 or bfloat16 activations, not {str(dtype).removeprefix('torch.')}"
    if requested == "auto":
        return "fast" if quantized_weights and problem is None else "exact"
    if requested == "fast" and problem is not None:
        raise ValueError(f"--numerics fast runs on ember's C++ CPU kernels, {problem}; use --numerics exact")
    return requested
