"""Qwen3.5's Gated DeltaNet: a linear-attention layer whose memory is a fixed-size state per
sequence, not a KV cache that grows with the context.

One fused input projection gives, per token, q/k/v (through a causal depthwise convolution and
SiLU), the output gate z, and b and a (the write strength beta = sigmoid(b) and the decay
exp(-exp(A_log) * softplus(a + dt_bias))). Per value head, the state S [key_dim, value_dim] then
decays, takes the delta rule's correction of what it recalls for k, and answers q:
    S = S * decay;  S += k (beta (v - S^T k))^T;  o = S^T q
(computed in one pass over S per token: see kernels/gated_delta_net.cpp)
(q and k l2-normalised per head, q scaled by key_dim^-1/2; each q/k head serves
num_value_heads / num_key_heads value heads, grouped or tiled). o goes through an RMSNorm gated by silu(z) and the
output projection.

The state pool (runner) gives every layer its tensors: the convolution's last inputs and S for
each slot. The recurrence runs token by token in prompts as in decodes, so a token's bits never
depend on how its prompt was chunked or batched; ember's C++ op runs it on CPU, the torch code
below elsewhere (the same steps, one token of one sequence at a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.recurrent_batch import RecurrentBatch
from ember_core.layers.recurrent_layer import MixerNormWeight, RecurrentLayer
from ember_core.models.decoder_config import LinearAttentionConfig

# The checkpoint's input projections, in the fused projection's row order.
INPUT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class GatedDeltaNet(RecurrentLayer):
    def __init__(self, config: LinearAttentionConfig, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        heads = config.num_value_heads
        self.in_proj = nn.Linear(hidden_size, config.conv_size + config.value_size + 2 * heads, bias=False)
        self.conv1d = nn.Conv1d(config.conv_size, config.conv_size, config.conv_kernel, groups=config.conv_size, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = MixerNormWeight(config.value_head_dim)
        self.out_proj = nn.Linear(config.value_size, hidden_size, bias=False)

    def input_rows(self) -> list[tuple[str, int]]:
        """The checkpoint's input projections and their rows in the fused in_proj."""
        c = self.config
        return list(zip(INPUT_PROJECTIONS, (c.conv_size, c.value_size, c.num_value_heads, c.num_value_heads)))

    def state_specs(self) -> list[tuple[tuple[int, ...], bool]]:
        """The convolution's last inputs in the model's dtype; per value head in float32, S and the last
        token's update of it still to apply ([decay | k | delta]: see gated_delta_net.cpp's recur)."""
        c = self.config
        return [
            ((c.conv_size, c.conv_kernel - 1), False),
            ((c.num_value_heads, c.key_head_dim, c.value_head_dim), True),
            ((c.num_value_heads, 1 + c.key_head_dim + c.value_head_dim), True),
        ]

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        projected = self.in_proj(hidden).contiguous()
        weight = self.conv1d.weight.view(self.config.conv_size, -1)
        operands = (projected, weight, self.A_log, self.dt_bias, self.norm.weight, self.eps, *self.states)
        c = self.config
        if projected.is_cpu and projected.dtype in (torch.float32, torch.bfloat16) and cpu_ops.is_available():
            mixed = cpu_ops.ops().gated_delta_net(
                *operands, batch.starts, batch.slots, batch.fresh, c.num_key_heads, c.key_head_dim, c.value_head_dim,
                c.tiled_value_heads,
            )
        else:
            mixed = _gated_delta_net_torch(c, *operands, batch)
        return self.out_proj(mixed)


def _gated_delta_net_torch(
    c: LinearAttentionConfig,
    projected: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    pending_state: torch.Tensor,
    batch: RecurrentBatch,
) -> torch.Tensor:
    """gated_delta_net.cpp's arithmetic in torch ops, one token of one sequence at a time (so every
    op sees the same shapes however the step is batched): S_t = g S_{t-1} + k delta^T applied as the
    next token reads S."""
    dtype, heads, group = projected.dtype, c.num_value_heads, c.num_value_heads // c.num_key_heads
    z_start, gates_start = c.conv_size, c.conv_size + c.value_size
    out = torch.empty(projected.shape[0], c.value_size, dtype=dtype, device=projected.device)
    starts = batch.starts.tolist()
    for seq, (slot, fresh) in enumerate(zip(batch.slots.tolist(), batch.fresh.tolist())):
        if fresh:
            conv_state[slot].zero_()
            recurrent_state[slot].zero_()
            pending_state[slot].zero_()
        state, pending = recurrent_state[slot], pending_state[slot]
        for token in range(starts[seq], starts[seq + 1]):
            row = projected[token]
            window = torch.cat([conv_state[slot], row[: c.conv_size, None]], dim=1)
            conv_state[slot].copy_(window[:, 1:])
            convolved = F.silu((window.float() * conv_weight.float()).sum(dim=1)).to(dtype).float()
            q, k, v = convolved.split([c.key_size, c.key_size, c.value_size])
            q = _l2_normalised(q.view(c.num_key_heads, -1)) * c.key_head_dim**-0.5
            k = _l2_normalised(k.view(c.num_key_heads, -1))
            if c.tiled_value_heads:
                q, k = q.repeat(group, 1), k.repeat(group, 1)
            else:
                q, k = q.repeat_interleave(group, dim=0), k.repeat_interleave(group, dim=0)
            b, a = row[gates_start : gates_start + heads].float(), row[gates_start + heads :].float()
            decay = torch.exp(-torch.exp(a_log.float()) * F.softplus(a + dt_bias.float()))
            last_decay, last_key, last_delta = pending.split([1, c.key_head_dim, c.value_head_dim], dim=1)
            state.copy_(state * last_decay[:, :, None] + last_key[:, :, None] * last_delta[:, None, :])
            reads_k, reads_q = (state * k[:, :, None]).sum(dim=1), (state * q[:, :, None]).sum(dim=1)
            delta = (v.view(heads, -1) - reads_k * decay[:, None]) * torch.sigmoid(b)[:, None]
            o = (reads_q * decay[:, None] + (k * q).sum(dim=1, keepdim=True) * delta).to(dtype).float()
            pending.copy_(torch.cat([decay[:, None], k, delta], dim=1))
            normed = (o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + eps)).to(dtype)
            z = row[z_start:gates_start].view(heads, -1).float()
            out[token] = ((norm_weight * normed).float() * F.silu(z)).to(dtype).view(-1)
    return out


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
