"""An embedding table kept in GGUF blocks or 16-bit rows, like `GGUFBlockLinear`'s weights."""

from __future__ import annotations

import gguf
import torch
from torch import nn

from ember_core.kernels import cpu_ops
from ember_core.layers.linear import GGUF_BLOCK_FORMATS


class GGUFBlockEmbedding(nn.Module):
    """`nn.Embedding` over uint8 blocks [num_embeddings, bytes per row]: a lookup expands only the
    rows it reads, to the float32 values the dequantized table holds, rounded to the model's
    `dtype`. A tied head can share the blocks, so neither keeps a float32 table (4 bytes x vocab x
    hidden: 1 GB for Llama 3.2 1B)."""

    def __init__(
        self, blocks: torch.Tensor, kind: gguf.GGMLQuantizationType, embedding_dim: int, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.kind = kind
        self.format = GGUF_BLOCK_FORMATS[kind]
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.dtype = dtype

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.name} blocks"

    def dequantized_weight(self) -> torch.Tensor:
        return cpu_ops.ops().gguf_dequantize(self.blocks, self.format, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        values = cpu_ops.ops().gguf_dequantize(rows, self.format, self.embedding_dim).to(self.dtype)
        return values.view(*ids.shape, self.embedding_dim)
