"""LFM2's gated short convolution: a recurrent layer whose whole state is its convolution's last
inputs. One projection gives B, C and x per token; y = C * conv(B * x), the causal depthwise
convolution over the last `kernel` values of B * x, then the output projection. Computed by
ember's C++ op on CPU (kernels/short_conv.cpp), the torch code below elsewhere (the same steps, one
token of one sequence at a time, so every op sees the same shapes however the step is batched).
"""

from __future__ import annotations

import torch
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.recurrent_batch import RecurrentBatch
from ember_core.layers.recurrent_layer import RecurrentLayer
from ember_core.models.decoder_config import ShortConvConfig


class ShortConv(RecurrentLayer):
    def __init__(self, config: ShortConvConfig, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=config.bias)
        self.conv = nn.Conv1d(hidden_size, hidden_size, config.kernel, groups=hidden_size, bias=config.bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=config.bias)

    def state_specs(self) -> list[tuple[tuple[int, ...], bool]]:
        return [((self.hidden_size, self.conv.kernel_size[0] - 1), False)]

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        projected = self.in_proj(hidden).contiguous()
        weight = self.conv.weight.view(self.hidden_size, -1)
        (state,) = self.states
        if projected.is_cpu and projected.dtype in (torch.float32, torch.bfloat16) and cpu_ops.is_available():
            mixed = cpu_ops.ops().short_conv(projected, weight, self.conv.bias, state, batch.starts, batch.slots, batch.fresh)
        else:
            mixed = _short_conv_torch(projected, weight, self.conv.bias, state, batch)
        return self.out_proj(mixed)


def _short_conv_torch(
    projected: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor, batch: RecurrentBatch
) -> torch.Tensor:
    """short_conv.cpp's arithmetic in torch ops, one token of one sequence at a time."""
    b, c, x = projected.chunk(3, dim=-1)
    out = torch.empty_like(x)
    starts = batch.starts.tolist()
    for seq, (slot, fresh) in enumerate(zip(batch.slots.tolist(), batch.fresh.tolist())):
        if fresh:
            state[slot].zero_()
        for token in range(starts[seq], starts[seq + 1]):
            window = torch.cat([state[slot], (b[token] * x[token])[:, None]], dim=1)
            state[slot].copy_(window[:, 1:])
            convolved = (window.float() * weight.float()).sum(dim=1)
            if bias is not None:
                convolved = convolved + bias.float()
            out[token] = c[token] * convolved.to(out.dtype)
    return out
