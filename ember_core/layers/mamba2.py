"""Granite 4.0-H's Mamba2 (state-space duality) mixer: a recurrent layer whose memory is a fixed-size
state per head, not a KV cache that grows with the context.

One input projection gives, per token, the gate z, x with the shared B and C (through a causal
depthwise convolution with SiLU), and a time step per head. Per head, with A = -exp(A_log) and
dt = softplus(dt + dt_bias) clamped to the time-step limits, the state S [state_size, head_dim]
decays and takes x's contribution; the output reads it through C and adds D's skip of x:
    S = S * exp(dt A) + (dt B) x^T;  y = S^T C + D x
(B and C are shared by the heads of each of num_groups groups). y times silu(z) goes through an
RMSNorm per group and the output projection.

The state pool (runner) gives the layer its tensors: the convolution's last inputs and S for each
slot. The recurrence runs token by token in prompts as in decodes, so a token's bits never depend on
how its prompt was chunked or batched; ember's C++ op runs it on CPU, the torch code below elsewhere
(the same steps, one token of one sequence at a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.recurrent_batch import RecurrentBatch
from ember_core.layers.recurrent_layer import MixerNormWeight, RecurrentLayer
from ember_core.models.decoder_config import Mamba2Config


class Mamba2(RecurrentLayer):
    def __init__(self, config: Mamba2Config, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        c = config
        self.in_proj = nn.Linear(hidden_size, c.projection_size, bias=c.projection_bias)
        self.conv1d = nn.Conv1d(c.conv_size, c.conv_size, c.conv_kernel, groups=c.conv_size, bias=c.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(c.num_heads))
        self.A_log = nn.Parameter(torch.zeros(c.num_heads))
        self.D = nn.Parameter(torch.ones(c.num_heads))
        self.norm = MixerNormWeight(c.inner_size)
        self.out_proj = nn.Linear(c.inner_size, hidden_size, bias=c.projection_bias)

    def state_specs(self) -> list[tuple[tuple[int, ...], bool]]:
        """The convolution's last inputs in the model's dtype, and S per head in float32, kept
        [state_size, head_dim] (the kernel updates a row of it across the head's channels at once)."""
        c = self.config
        return [((c.conv_size, c.conv_kernel - 1), False), ((c.num_heads, c.state_size, c.head_dim), True)]

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        projected = self.in_proj(hidden).contiguous()
        c = self.config
        weight = self.conv1d.weight.view(c.conv_size, -1)
        operands = (projected, weight, self.conv1d.bias, self.A_log, self.dt_bias, self.D, self.norm.weight, self.eps)
        if projected.is_cpu and projected.dtype in (torch.float32, torch.bfloat16) and cpu_ops.is_available():
            mixed = cpu_ops.ops().mamba2(
                *operands, *self.states, batch.starts, batch.slots, batch.fresh, c.num_groups, c.time_step_min,
                c.time_step_max,
            )
        else:
            mixed = _mamba2_torch(c, *operands, *self.states, batch)
        return self.out_proj(mixed)


def _mamba2_torch(
    c: Mamba2Config,
    projected: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    d_skip: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: RecurrentBatch,
) -> torch.Tensor:
    """mamba2.cpp's arithmetic in torch ops, one token of one sequence at a time (so every op sees the
    same shapes however the step is batched)."""
    dtype, inner, groups = projected.dtype, c.inner_size, c.num_groups
    heads_per_group = c.num_heads // groups
    rate = -torch.exp(a_log.float())
    out = torch.empty(projected.shape[0], inner, dtype=dtype, device=projected.device)
    starts = batch.starts.tolist()
    for seq, (slot, fresh) in enumerate(zip(batch.slots.tolist(), batch.fresh.tolist())):
        if fresh:
            conv_state[slot].zero_()
            ssm_state[slot].zero_()
        state = ssm_state[slot]
        for token in range(starts[seq], starts[seq + 1]):
            row = projected[token]
            window = torch.cat([conv_state[slot], row[inner : inner + c.conv_size, None]], dim=1)
            conv_state[slot].copy_(window[:, 1:])
            convolved = (window.float() * conv_weight.float()).sum(dim=1)
            if conv_bias is not None:
                convolved = conv_bias.float() + convolved
            convolved = F.silu(convolved).to(dtype).float()
            x, b, cc = convolved.split([inner, groups * c.state_size, groups * c.state_size])
            b = b.view(groups, -1).repeat_interleave(heads_per_group, dim=0)
            cc = cc.view(groups, -1).repeat_interleave(heads_per_group, dim=0)
            raw = row[inner + c.conv_size :]
            dt = F.softplus((raw + dt_bias).to(dtype).float()).to(dtype).float().clamp(c.time_step_min, c.time_step_max)
            x = x.view(c.num_heads, c.head_dim)
            state.mul_(torch.exp(dt * rate)[:, None, None])
            state.add_((dt[:, None] * b)[:, :, None] * x[:, None, :])
            y = (state * cc[:, :, None]).sum(dim=1) + d_skip.float()[:, None] * x
            gate = row[:inner].float()
            gated = (y.to(dtype).float().view(-1) * F.silu(gate)).view(groups, -1)
            normed = gated * torch.rsqrt(gated.pow(2).mean(dim=-1, keepdim=True) + eps)
            out[token] = (norm_weight.float() * normed.view(-1)).to(dtype)
    return out
