import numpy as np

from ember_core import SamplingParams
from ember_core.cache import BlockManager
from ember_core.cache.block_hash import extend_block_hashes
from ember_core.engine.block_map import block_holders
from ember_core.engine.sequence import Sequence
from ember_proto import BLOCK_CACHED, BLOCK_FREE, BLOCK_HELD


def _sequence(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id, f"req-{seq_id}", prompt, SamplingParams(), 0.0)


def _decoded(holders: bytes) -> list[int]:
    return np.frombuffer(holders, dtype="<u2").tolist()


def test_each_block_is_free_cached_or_named_by_a_holder() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    first, second, done = _sequence(0, [1, 2, 3]), _sequence(1, [4, 5, 6, 7, 8]), _sequence(2, [9, 10, 11, 12])
    for seq in (first, second, done):
        bm.grow(seq.seq_id, seq.num_tokens)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, done.prompt_token_ids, 2, 2)
    bm.offer_full_blocks(done.seq_id, hashes, 2)
    cached = bm.block_table(done.seq_id)
    bm.free(done.seq_id)
    holders, running = block_holders(bm, [first, second])
    expected = [BLOCK_FREE] * 8
    for block in cached:
        expected[block] = BLOCK_CACHED
    for index, seq in enumerate((first, second)):
        for block in bm.block_table(seq.seq_id):
            expected[block] = BLOCK_HELD + index
    assert _decoded(holders) == expected
    assert running == ["req-0", "req-1"]


def test_a_shared_cached_block_names_its_youngest_holder() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    owner, sharer = _sequence(0, [1, 2, 3]), _sequence(1, [1, 2, 5])
    bm.grow(owner.seq_id, owner.num_tokens)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, owner.prompt_token_ids, 2, 1)
    bm.offer_full_blocks(owner.seq_id, hashes, 1)
    bm.share(sharer.seq_id, bm.cached_prefix(hashes))
    bm.grow(sharer.seq_id, sharer.num_tokens)
    shared = bm.block_table(owner.seq_id)[0]
    holders, _ = block_holders(bm, [owner, sharer])
    assert _decoded(holders)[shared] == BLOCK_HELD + 1
