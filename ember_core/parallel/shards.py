"""Which part of each checkpoint tensor a tensor-parallel rank holds, as Megatron splits a decoder:
q/k/v and gate/up by output rows (column-parallel), o and down by input columns (row-parallel, one
sum across ranks after each), the embedding and the head by vocabulary rows, and every expert of a
mixture by its intermediate rows. A rank's K/V heads are the ones its query heads read: split where
there are at least as many as ranks, else each rank keeps the one its heads share (replicated).
Norms, the router and the shared expert's gate are whole on every rank, but for q and k norms that
span all heads (OLMo 2), split as q and k are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ember_core.models.decoder_config import DecoderConfig
from ember_core.parallel.group import TensorParallel
from ember_core.parallel.sliceable import Sliceable, shape_of
from ember_core.parallel.vocab import VocabSplit


@dataclass(frozen=True)
class DecoderShards:
    config: DecoderConfig  # the whole model's
    parallel: TensorParallel

    def __post_init__(self) -> None:
        c, n = self.config, self.parallel.world_size
        if c.is_hybrid:
            raise ValueError(
                "tensor parallelism does not split a hybrid model's recurrent layers yet: use --tensor-parallel-size 1"
            )
        checks = [
            (c.num_heads % n == 0, f"its {c.num_heads} attention heads"),
            (c.num_kv_heads % n == 0 or n % c.num_kv_heads == 0, f"its {c.num_kv_heads} KV heads (nor do they divide it)"),
            (c.intermediate_size % n == 0, f"its MLP's {c.intermediate_size} rows"),
            (c.moe is None or c.moe.expert_size % n == 0, "its experts' rows"),
            (c.moe is None or c.moe.shared_expert_size % n == 0, "its shared expert's rows"),
        ]
        for fits, what in checks:
            if not fits:
                raise ValueError(f"tensor parallel size {n} does not divide {what}")

    @property
    def vocab(self) -> VocabSplit:
        return VocabSplit(self.config.vocab_size, self.parallel)

    def local_config(self) -> DecoderConfig:
        """The sizes of this rank's layers."""
        c, n = self.config, self.parallel.world_size
        moe = c.moe and dataclasses.replace(
            c.moe, expert_size=c.moe.expert_size // n, shared_expert_size=c.moe.shared_expert_size // n
        )
        return dataclasses.replace(
            c, vocab_size=self.vocab.local_size, num_heads=c.num_heads // n, num_kv_heads=max(c.num_kv_heads // n, 1),
            intermediate_size=c.intermediate_size // n, moe=moe,
        )

    @property
    def counts_its_kv_heads(self) -> bool:
        """Whether this rank is the first to hold its K/V heads (the only one, unless they are
        replicated over more ranks than there are heads)."""
        c, n = self.config, self.parallel.world_size
        return c.num_kv_heads >= n or self.parallel.rank % (n // c.num_kv_heads) == 0

    def _q_rows(self) -> slice:
        size = self.config.num_heads // self.parallel.world_size * self.config.head_dim
        return slice(self.parallel.rank * size, (self.parallel.rank + 1) * size)

    def _kv_rows(self) -> slice:
        c, n = self.config, self.parallel.world_size
        first_query_head = self.parallel.rank * (c.num_heads // n)
        kv_heads = max(c.num_kv_heads // n, 1)
        first = first_query_head // (c.num_heads // c.num_kv_heads)
        return slice(first * c.head_dim, (first + kv_heads) * c.head_dim)

    def _split(self, size: int) -> slice:
        part = size // self.parallel.world_size
        return slice(self.parallel.rank * part, (self.parallel.rank + 1) * part)

    def take(self, name: str, source: Sliceable) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (HF's), read from source."""
        shape = shape_of(source)
        kind = _kind(name, self.config.family.qk_norm == "projection")
        if kind == "vocab":
            return self.vocab.rows(source)
        if kind == "q":
            return source[self._q_rows()]
        if kind == "kv":
            return source[self._kv_rows()]
        if kind == "qkv":  # Phi-3 stores q, k and v stacked
            whole = source[:]
            q_size = self.config.num_heads * self.config.head_dim
            kv_size = self.config.num_kv_heads * self.config.head_dim
            q, k, v = whole.split([q_size, kv_size, kv_size])
            return torch.cat([q[self._q_rows()], k[self._kv_rows()], v[self._kv_rows()]])
        if kind == "rows":
            return source[self._split(shape[0])]
        if kind == "gate_up":  # Phi-3 stores gate and up stacked
            gate, up = source[:].chunk(2)
            return torch.cat([gate[self._split(gate.shape[0])], up[self._split(up.shape[0])]])
        if kind == "o_columns":
            return source[:, self._q_rows()]
        if kind == "columns":
            return source[:, self._split(shape[1])]
        whole = source[:]
        if kind == "once":  # a row-parallel linear's bias: added once to the ranks' sum
            return whole if self.parallel.is_leader else torch.zeros_like(whole)
        return whole


_COLUMN_PARALLEL = ("gate_proj", "up_proj", "w1", "w3")
_ROW_PARALLEL = ("down_proj", "w2")


def _kind(name: str, projection_norms: bool) -> str:
    """How tensor `name` splits: by vocabulary rows, query or K/V head rows, rows or columns evenly,
    only on the leader, or not at all ("whole"). projection_norms: q and k norms span all heads."""
    module, _, parameter = name.removeprefix("model.").rpartition(".")
    last = module.rpartition(".")[2]
    if module in ("embed_tokens", "lm_head"):
        return "vocab"
    if last == "q_proj" or (projection_norms and last == "q_norm"):
        return "q"
    if last in ("k_proj", "v_proj") or (projection_norms and last == "k_norm"):
        return "kv"
    if last == "qkv_proj":
        return "qkv"
    if last == "o_proj":
        return "o_columns" if parameter == "weight" else "once"
    if last == "gate_up_proj":
        return "gate_up"
    if last in _COLUMN_PARALLEL:
        return "rows"
    if last in _ROW_PARALLEL:
        return "columns" if parameter == "weight" else "once"
    return "whole"
