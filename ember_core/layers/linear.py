"""Linear layers for serving: the tied output head, and CPU weights pre-packed for oneDNN.

On CPU, `F.linear` hands each call to MKL's sgemm, which repacks the whole weight matrix on every
call; at decode batch sizes (1-64 rows) that repacking costs more than the product itself. oneDNN
can reorder a weight once into its blocked layout and reuse it for any number of rows: on a 2-core
AVX2 machine this made the SmolLM2 layer matmuls 1.6x and its 49152 x 576 LM head 2.7x faster
at batch 16 (docs/benchmarks.md). torch uses the same two ops for frozen linears under
`torch.compile`; they are private, so packing falls back to plain `nn.Linear` wherever they are
missing or refuse the weight.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def tied_head(embedding: nn.Embedding) -> nn.Linear:
    """An output head sharing the embedding's weight (logits = hidden @ embedding.T)."""
    head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
    head.weight = embedding.weight
    return head


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight oneDNN reordered once into its blocked layout (CPU only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    @property
    def weight(self) -> torch.Tensor:
        """A plain [out_features, in_features] copy of the weight, for inspection."""
        return self.packed_weight.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of a CPU model by a `PackedLinear`; returns how many were packed.

    A tied head gets its own packed copy; the embedding keeps the plain weight for its lookups.
    """
    param = next(model.parameters())
    if not can_pack(param.device, param.dtype):
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for count, (parent, name, child) in enumerate(targets):
        try:
            setattr(parent, name, PackedLinear(child))
        except RuntimeError as error:  # the layers packed so far and the plain ones compute the same
            logger.warning("oneDNN weight packing failed, keeping plain linear layers: %s", error)
            return count
    return len(targets)
