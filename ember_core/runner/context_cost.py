"""What a prompt token's attention over earlier positions costs, in units of its own linear layers.

A prompt chunk of n tokens after c computed ones runs n tokens through the linears and attends over
n * c earlier positions. At long context the second term dominates: for SmolLM2 a token at position
3,000 costs about twice a token at position 0. The scheduler charges chunks for it, so a step's
compute, and with it the other streams' inter-token latency, stays bounded at any context.
"""

from __future__ import annotations

from torch import nn

from ember_core.layers.attention import PagedAttention


def context_cost_per_position(model: nn.Module) -> float:
    """Multiply-adds of attending one token to one earlier position (QK^T and PV in every layer), over
    the multiply-adds of one token's linear layers (projections and MLP; not the LM head, which only
    sampled rows run)."""
    attention = sum(2 * m.num_heads * m.head_dim for m in model.modules() if isinstance(m, PagedAttention))
    linears = _linear_macs(model) - _linear_macs(model.lm_head)
    return attention / linears


def _linear_macs(module: nn.Module) -> int:
    """Multiply-adds per row of the outermost linear layers under module (a stacked linear counts once)."""
    if hasattr(module, "in_features"):
        return module.in_features * module.out_features
    return sum(_linear_macs(child) for child in module.children())
