"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Qwen3.5-MoE and Granite 4.0-H.

A router's softmax (in float32) scores every expert for each token; the token runs its top_k experts'
gated MLPs and adds their outputs, each times its probability (renormalised over the top k where the
family says so). Qwen2-MoE adds a shared expert that every token runs, gated by a sigmoid; Granite
4.0-H one ungated.

On CPU one C++ call (kernels/moe_experts.cpp) groups a step's tokens by expert and runs each selected
expert once for its tokens, from its dense rows or its GGUF blocks: a step reads the experts it
selected and no others. Each token's output is its experts' outputs added in expert order onto zero,
the order transformers adds them in, and the linears' rows never depend on each other, so a token's
output does not depend on the tokens it shares a step (or an expert) with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.activation import GATED_ACTIVATIONS, sigmoid_mul
from ember_core.layers.linear import PLAIN_WEIGHT_FORMAT, SIXTEEN_BIT_ROW_MULTIPLE, kernel_format_code
from ember_core.layers.mlp import MLP
from ember_core.models.decoder_config import MoEConfig


class Experts(nn.Module):
    """num_experts gated MLPs, stacked: gate_up [experts, 2 * expert_size, hidden] (each expert's gate
    rows, then its up rows) and down [experts, hidden, expert_size]; as dense weights (the model's
    dtype, format PLAIN_WEIGHT_FORMAT) or, from a GGUF file, as uint8 blocks of a GGUF block format."""

    def __init__(self, num_experts: int, hidden_size: int, expert_size: int, activation: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * expert_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, expert_size))
        self.gate_up_format = self.down_format = PLAIN_WEIGHT_FORMAT
        self.hidden_size, self.expert_size = hidden_size, expert_size
        self.activation = activation
        self.int8 = False  # the fast numerics over blocks: int8_weights.use_int8_arithmetic sets it

    def keep_blocks(self, gate_up: torch.Tensor, gate_up_format: int, down: torch.Tensor, down_format: int) -> None:
        """Run from GGUF blocks: gate_up [experts, 2 * expert_size, bytes], down [experts, hidden, bytes]."""
        del self.gate_up_proj, self.down_proj
        self.register_buffer("gate_up_proj", gate_up)
        self.register_buffer("down_proj", down)
        self.gate_up_format, self.down_format = gate_up_format, down_format

    def extra_repr(self) -> str:
        experts = self.gate_up_proj.shape[0]
        stored = "dense" if self.gate_up_format == PLAIN_WEIGHT_FORMAT else f"formats {self.gate_up_format}/{self.down_format}"
        arithmetic = ", int8 arithmetic" if self.int8 else ""
        return f"experts={experts}, hidden_size={self.hidden_size}, expert_size={self.expert_size}, {stored}{arithmetic}"

    def _on_kernel(self, x: torch.Tensor) -> bool:
        if not (x.is_cpu and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and cpu_ops.is_available()):
            return False
        dense_bf16 = x.dtype == torch.bfloat16 and self.gate_up_format == PLAIN_WEIGHT_FORMAT
        return not dense_bf16 or (self.hidden_size % SIXTEEN_BIT_ROW_MULTIPLE == 0 and self.expert_size % SIXTEEN_BIT_ROW_MULTIPLE == 0)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """expert_ids [tokens, top_k] (int64) and expert_weights [tokens, top_k] (x's dtype)."""
        if self._on_kernel(x):
            return cpu_ops.ops().moe_experts(
                x.contiguous(), expert_ids, expert_weights, self.gate_up_proj, kernel_format_code(self.gate_up_format, self.int8),
                self.down_proj, kernel_format_code(self.down_format, self.int8), self.activation == "gelu_tanh",
            )
        return self._forward_loop(x, expert_ids, expert_weights)

    def _forward_loop(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """The same sums in torch ops, for devices and dtypes the kernel does not take (dense weights)."""
        out = torch.zeros_like(x)
        act_and_mul = GATED_ACTIVATIONS[self.activation]
        for expert in expert_ids.unique().tolist():  # ascending
            tokens, slots = torch.where(expert_ids == expert)
            y = F.linear(act_and_mul(F.linear(x[tokens], self.gate_up_proj[expert])), self.down_proj[expert])
            out.index_add_(0, tokens, y * expert_weights[tokens, slots, None])
        return out


class SparseMoE(nn.Module):
    def __init__(self, moe: MoEConfig, hidden_size: int, activation: str) -> None:
        super().__init__()
        self.config, self.hidden_size = moe, hidden_size
        self.top_k, self.normalize_top_k = moe.top_k, moe.normalize_top_k
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = Experts(moe.num_experts, hidden_size, moe.expert_size, activation)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(hidden_size, moe.shared_expert_size, False, activation)
        if moe.shared_expert_size and moe.shared_expert_gated:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        # Tokens routed to each expert since the model loaded, for /metrics (a step adds its own).
        self.routed_tokens = torch.zeros(moe.num_experts, dtype=torch.int64, device="cpu")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids, weights in x's dtype), [tokens, top_k] each; ties go as torch.topk, which
        transformers uses, breaks them."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights /= weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.route(x)
        self.routed_tokens += torch.bincount(expert_ids.flatten().cpu(), minlength=self.routed_tokens.shape[0])
        out = self.experts(x, expert_ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is None:  # Granite's
            out = out + self.shared_expert(x)
        elif self.shared_expert is not None:
            shared = self.shared_expert(x)
            # sigmoid_mul: torch.sigmoid's vector code and its scalar tail round apart, and which of
            # them a token's gate meets would depend on how many tokens the step holds.
            out = out + sigmoid_mul(shared, self.shared_expert_gate(x).expand_as(shared).contiguous())
        return out


def routed_tokens_by_layer(model: nn.Module) -> list[list[int]]:
    """Per decoder layer, the tokens routed to each of its experts so far ([] for a dense layer); [] for
    a model without experts."""
    layers = getattr(model, "layers", None)
    if layers is None or not any(isinstance(layer.mlp, SparseMoE) for layer in layers):
        return []
    return [layer.mlp.routed_tokens.tolist() if isinstance(layer.mlp, SparseMoE) else [] for layer in layers]
