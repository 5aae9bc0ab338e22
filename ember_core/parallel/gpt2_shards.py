"""Which part of each GPT-2 checkpoint tensor a tensor-parallel rank holds. GPT-2 stores its linears
as Conv1D, [in, out]: c_attn's q, k and v columns and c_fc's columns split by head and by rows of
the MLP (column-parallel), attn.c_proj's and mlp.c_proj's rows (row-parallel, bias on the leader);
the token embedding and head by vocabulary rows; positions and LayerNorms whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember_core.models.gpt2_config import GPT2Config
from ember_core.parallel.group import TensorParallel
from ember_core.parallel.sliceable import Sliceable
from ember_core.parallel.vocab import VocabSplit


@dataclass(frozen=True)
class GPT2Shards:
    config: GPT2Config  # the whole model's
    parallel: TensorParallel

    def __post_init__(self) -> None:
        c, n = self.config, self.parallel.world_size
        if c.num_heads % n or c.intermediate_size % n:
            raise ValueError(f"tensor parallel size {n} does not divide GPT-2's {c.num_heads} heads and {c.intermediate_size} MLP rows")

    @property
    def vocab(self) -> VocabSplit:
        return VocabSplit(self.config.vocab_size, self.parallel)

    @property
    def local_heads(self) -> int:
        return self.config.num_heads // self.parallel.world_size

    @property
    def local_intermediate_size(self) -> int:
        return self.config.intermediate_size // self.parallel.world_size

    def _part(self, size: int) -> slice:
        return slice(self.parallel.rank * size, (self.parallel.rank + 1) * size)

    def take(self, name: str, source: Sliceable) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (HF's), read from source."""
        name = name.removeprefix("transformer.")
        heads = self._part(self.local_heads * self.config.head_dim)
        mlp_rows = self._part(self.local_intermediate_size)
        if name in ("wte.weight", "lm_head.weight"):
            return self.vocab.rows(source)
        if name.endswith("attn.c_attn.weight"):
            return torch.cat([part[:, heads] for part in source[:].chunk(3, dim=1)], dim=1)
        if name.endswith("attn.c_attn.bias"):
            return torch.cat([part[heads] for part in source[:].chunk(3)])
        if name.endswith("attn.c_proj.weight"):
            return source[heads]
        if name.endswith("mlp.c_fc.weight"):
            return source[:, mlp_rows]
        if name.endswith("mlp.c_fc.bias"):
            return source[mlp_rows]
        if name.endswith("mlp.c_proj.weight"):
            return source[mlp_rows]
        whole = source[:]
        if name.endswith("c_proj.bias"):  # a row-parallel linear's: added once to the ranks' sum
            return whole if self.parallel.is_leader else torch.zeros_like(whole)
        return whole
