import pytest

from ember_core.cache import BlockManager


def test_blocks_are_allocated_only_when_the_last_is_full() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.grow(seq_id=1, num_tokens=1)
    assert len(bm.block_table(1)) == 1
    bm.grow(1, 4)
    assert len(bm.block_table(1)) == 1
    bm.grow(1, 5)
    assert len(bm.block_table(1)) == 2
    assert bm.num_free_blocks == 6


def test_free_returns_every_block_and_ref_counts_drop_to_zero() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.grow(1, 5)
    bm.grow(2, 3)
    held = bm.block_table(1) + bm.block_table(2)
    assert len(set(held)) == 5
    assert all(bm.ref_count(b) == 1 for b in held)
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 6
    assert all(bm.ref_count(b) == 0 for b in held)
    assert bm.block_table(1) == []


def test_exhaustion_is_reported_and_nothing_is_half_allocated() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.grow(1, 8)
    assert not bm.can_grow(2, 5)
    assert bm.can_grow(2, 4)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.grow(2, 5)
    assert bm.num_free_blocks == 1 and bm.block_table(2) == []


def test_freed_blocks_are_reused() -> None:
    bm = BlockManager(num_blocks=2, block_size=1)
    bm.grow(1, 2)
    first = set(bm.block_table(1))
    bm.free(1)
    bm.grow(2, 2)
    assert set(bm.block_table(2)) == first
