"""The gated activations on the MLP's fused gate/up output: SwiGLU (silu) and GeGLU (GELU's tanh
approximation, Gemma)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ember_core.kernels import cpu_ops


def _on_kernel(gate_up: torch.Tensor) -> bool:
    return gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.is_cpu and gate_up.dim() == 2 and cpu_ops.is_available()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim; one C++ call on float32 or
    bfloat16 CPU rows, where chunk + silu + mul cost ~10x more at decode sizes (the silu reads a
    strided half)."""
    if _on_kernel(gate_up):
        return cpu_ops.ops().silu_and_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, as silu_and_mul."""
    if _on_kernel(gate_up):
        return cpu_ops.ops().gelu_tanh_and_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) (a gated attention's output), one C++ call where it runs: each element's bits
    then do not depend on where in the batch it sits (torch's vector and tail code differ)."""
    if _on_kernel(x):
        return cpu_ops.ops().sigmoid_mul(x.contiguous(), gate.contiguous())
    return x * torch.sigmoid(gate)


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}
