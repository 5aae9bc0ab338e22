"""Linear layers for serving: the tied output head, and a CPU path for decode-sized batches.

On CPU, `F.linear` hands every call to BLAS sgemm, which repacks the whole weight matrix each
time; at decode batch sizes that costs more than the product. `SmallBatchLinear` sends batches of
up to `SMALL_BATCH_ROWS` rows to ember's C++ kernel, which streams the weight once, in place
(kernels/small_batch_linear.cpp), and larger ones (prefill) to `F.linear`. It is an `nn.Linear`
holding the same parameters: no copy, a tied head still shares the embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember_core.kernels import cpu_ops

# Up to here the C++ kernel beat MKL sgemm for the SmolLM2 shapes on a 2-core AVX2 machine
# (`python -m ember_core.kernels.bench_linear`, docs/benchmarks.md); at 64 rows sgemm won.
SMALL_BATCH_ROWS = 32


def tied_head(embedding: nn.Embedding) -> nn.Linear:
    """An output head sharing the embedding's weight (logits = hidden @ embedding.T)."""
    head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
    head.weight = embedding.weight
    return head


class SmallBatchLinear(nn.Linear):
    """`nn.Linear` (CPU, float32) that runs batches of at most SMALL_BATCH_ROWS rows on ember's kernel."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> SmallBatchLinear:
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
            return torch.ops.ember.small_batch_linear(x.contiguous(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_small_batch_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of a float32 CPU model for a `SmallBatchLinear` when the C++ ops
    are available; returns how many were swapped."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32 or not cpu_ops.is_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, SmallBatchLinear.sharing(child))
    return len(targets)
