"""The KV pool block by block, for dashboards (ember_proto.BlockMap): built a few times a second at
most, and only while a gateway asks, with array scatters rather than a Python loop per block, so
that a pool of 64k blocks costs a fraction of a millisecond."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ember_core.cache.block_manager import DROPPED_BLOCK, BlockManager
from ember_core.engine.sequence import Sequence
from ember_proto import BLOCK_CACHED, BLOCK_HELD


def block_holders(block_manager: BlockManager, running: Iterable[Sequence]) -> tuple[bytes, list[str]]:
    """One little-endian unsigned 16-bit value per block (BLOCK_FREE, BLOCK_CACHED, or BLOCK_HELD
    plus the index of a running sequence holding it; of a shared block, the youngest holder), and
    the running sequences' request ids in that order."""
    holders = np.zeros(block_manager.num_blocks, dtype="<u2")
    holders[block_manager.cached_block_ids()] = BLOCK_CACHED
    request_ids = []
    for index, seq in enumerate(running):
        request_ids.append(seq.request_id)
        for table in block_manager.block_tables(seq.seq_id):
            blocks = np.asarray(table, dtype=np.int64)
            holders[blocks[blocks != DROPPED_BLOCK]] = BLOCK_HELD + index
    return holders.tobytes(), request_ids
