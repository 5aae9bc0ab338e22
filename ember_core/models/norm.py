"""RMSNorm over the last dimension, on ember's C++ op where it runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight. A family whose norms multiply by (1 + w) (Gemma) has
    the 1 added to its weights at load, so one formula serves all."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu and x.dim() == 2 and cpu_ops.is_available():
            return cpu_ops.ops().rms_norm(x.contiguous(), self.weight, self.eps)  # one C++ call, not ~10 ops
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # bit-identical to the lines below
        # Normalise in float32 and cast back before the weight, as transformers does, so fp16/bf16 agree.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward_(self, x: torch.Tensor) -> torch.Tensor:
        """Each of x's [rows, groups, size] vectors normalised in place (x may be a strided view of
        contiguous vectors: the q or k heads of a fused QKV output); returns x."""
        if x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu and x.stride(-1) == 1 and cpu_ops.is_available():
            cpu_ops.ops().rms_norm_(x, self.weight, self.eps)
            return x
        return x.copy_(self(x))
