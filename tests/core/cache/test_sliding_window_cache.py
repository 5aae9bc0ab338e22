"""Per-window-group block tables: a sliding-window group drops the blocks no token left to compute
attends to, a full-attention group keeps them all, and admission, preemption, reservations and the
prefix cache work across groups. Driven without a model: KVSlots plays the runner (what each block
slot holds), so a wrong table shows up as a read of K/V computed for another prefix or group."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from ember_core.cache import DROPPED_BLOCK, BlockManager
from ember_core.cache.block_hash import extend_block_hashes
from ember_core.cache.cache_hit import longest_cache_hit
from ember_core.engine.scheduler import Scheduler, SchedulerOutput
from ember_core.engine.sequence import FinishReason, Sequence
from ember_core.sampling_params import SamplingParams
from tests.core.engine.test_scheduler import make_scheduler, make_seq


def hashes_of(tokens: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, block_size, len(tokens) // block_size)
    return hashes


def held(bm: BlockManager, seq_id: int) -> list[list[int]]:
    """Per group, the blocks the sequence holds."""
    return [[b for b in table if b != DROPPED_BLOCK] for table in bm.block_tables(seq_id)]


def blocks_attended(first_position: int, end: int, window: int | None, block_size: int) -> list[int]:
    """The table indices a chunk of positions [first_position, end) reads, from the definition."""
    start = 0 if window is None else max(0, first_position - window + 1)
    return sorted({q // block_size for q in range(start, end)})


def layer_groups(layer_windows: list[int | None], layers_per_group: int) -> tuple[int | None, ...]:
    """The runner's grouping: each attention kind's layers in groups of layers_per_group."""
    counts = Counter(layer_windows)
    return tuple(w for w, count in counts.items() for _ in range(math.ceil(count / layers_per_group)))


class KVSlots:
    """The KV pool as the runner uses it: a step writes its chunks' K/V, then attends. A slot holds
    (group, prefix id) of what was written there; every slot a chunk attends to must hold its own
    group's K/V of the same prefix, and no table may hold more or fewer blocks than its window needs."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.bm = scheduler.block_manager
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self._prefix_ids: dict[tuple[int, int], int] = {}  # (parent prefix id, token) -> prefix id
        self._seq_prefixes: dict[int, list[int]] = {}

    def step(self, out: SchedulerOutput) -> None:
        self.check_ownership()
        size = self.bm.block_size
        chunks = [
            (seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
            for seq, n in zip(out.seqs, out.num_scheduled_tokens)
        ]
        for seq, start, end in chunks:
            for window, table in zip(self.bm.group_windows, self.bm.block_tables(seq.seq_id)):
                assert len(table) == -(-end // size)
                needed = blocks_attended(start, end, window, size)
                assert [i for i, b in enumerate(table) if b != DROPPED_BLOCK] == needed
        for seq, start, end in chunks:
            prefixes = self._prefixes(seq, end)
            for group, table in enumerate(self.bm.block_tables(seq.seq_id)):
                for p in range(start, end):
                    self.slots[table[p // size], p % size] = (group, prefixes[p])
        for seq, start, end in chunks:
            prefixes = self._prefixes(seq, end)
            for group, (window, table) in enumerate(zip(self.bm.group_windows, self.bm.block_tables(seq.seq_id))):
                first = 0 if window is None else max(0, start - window + 1)
                for q in range(first, end):
                    assert self.slots.get((table[q // size], q % size)) == (group, prefixes[q]), (seq.seq_id, group, q)

    def check_ownership(self) -> None:
        """A block serves one group at a time, and its reference count is the number of its holders."""
        holders: Counter[int] = Counter()
        owner: dict[int, int] = {}
        for seq_id in self.scheduler.running:
            for group, blocks in enumerate(held(self.bm, seq_id)):
                for block_id in blocks:
                    holders[block_id] += 1
                    assert owner.setdefault(block_id, group) == group
        assert all(self.bm.ref_count(b) == n for b, n in holders.items())
        assert self.bm.num_used_blocks == len(holders)

    def _prefixes(self, seq: Sequence, end: int) -> list[int]:
        """Ids of seq's prefixes token_ids[: q + 1], equal exactly when the prefixes are."""
        ids = self._seq_prefixes.setdefault(seq.seq_id, [])
        while len(ids) < end:
            key = (ids[-1] if ids else -1, seq.token_ids[len(ids)])
            ids.append(self._prefix_ids.setdefault(key, len(self._prefix_ids)))
        return ids


def advance(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the model ran (as tests/core/engine/test_scheduler.run_step)."""
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        seq.num_computed_tokens += n
        s.cache_computed_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                s.finish(seq, FinishReason.LENGTH)


def run_checked(s: Scheduler, kv: KVSlots, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not s.num_unfinished:
            break
        out = s.schedule()
        kv.step(out)
        advance(s, out)
    assert not s.num_unfinished
    assert_pool_free(s.block_manager)


def assert_pool_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


# --- the block manager alone -------------------------------------------------------------------


def test_a_window_group_drops_what_the_next_tokens_do_not_attend_to() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, group_windows=(None, 6))
    bm.grow(1, 12)
    full, window = (list(table) for table in bm.block_tables(1))
    assert len(full) == len(window) == 3 and bm.num_free_blocks == 10
    bm.grow(1, 13, num_computed=12)  # position 12 attends to 7..12: block 0 (positions 0..3) goes
    assert bm.block_tables(1)[0][:3] == full and len(bm.block_tables(1)[0]) == 4
    assert bm.block_tables(1)[1][:3] == [DROPPED_BLOCK, *window[1:]]
    assert bm.ref_count(window[0]) == 0 and bm.num_free_blocks == 16 - 7
    bm.free(1)
    assert_pool_free(bm)


@pytest.mark.parametrize(("window", "block_size"), [(1, 1), (1, 4), (3, 4), (4, 4), (5, 4), (16, 4), (7, 3)])
def test_steady_decoding_holds_exactly_the_window(window: int, block_size: int) -> None:
    bm = BlockManager(num_blocks=64, block_size=block_size, group_windows=(window, None))
    for position in range(60):
        bm.grow(1, position + 1, num_computed=position)
        windowed, full = held(bm, 1)
        table = bm.block_tables(1)[0]
        assert [table.index(b) for b in windowed] == blocks_attended(position, position + 1, window, block_size)
        assert len(windowed) <= math.ceil(window / block_size) + 1
        assert len(full) == position // block_size + 1
    bm.free(1)
    assert_pool_free(bm)


def test_growing_counts_the_blocks_dropping_returns() -> None:
    bm = BlockManager(num_blocks=2, block_size=4, group_windows=(4,))
    bm.grow(1, 8)
    assert bm.num_free_blocks == 0
    assert not bm.can_grow(1, 9) and bm.num_missing_blocks(1, 9) == 1
    assert bm.can_grow(1, 9, num_computed=8) and bm.num_missing_blocks(1, 9, num_computed=8) == 0
    first = bm.block_table(1)[0]
    bm.grow(1, 9, num_computed=8)
    assert bm.block_table(1) == [DROPPED_BLOCK, bm.block_table(1)[1], first]  # the dropped block, reused


def test_a_dropped_block_another_sequence_holds_does_not_return() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, group_windows=(4,))
    tokens = list(range(8))
    bm.grow(1, 8)
    bm.offer_full_blocks(1, hashes_of(tokens, 4), 2)
    bm.share(2, bm.cached_prefix(hashes_of(tokens, 4)[:1]))  # seq 2 holds seq 1's block 0
    assert bm.num_free_blocks == 1
    assert bm.num_missing_blocks(1, 12, num_computed=8) == 1  # dropping block 0 frees nothing
    bm.grow(1, 12, num_computed=8)
    assert bm.num_free_blocks == 0 and bm.ref_count(bm.block_table(2)[0]) == 1
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.grow(1, 13, num_computed=8)
    assert len(bm.block_table(1)) == 3  # nothing half done
    bm.free(1)
    bm.free(2)
    assert_pool_free(bm)


@pytest.mark.parametrize(("windows", "block_size", "chunk", "num_tokens"), [
    ((None,), 4, 16, 50),
    ((8,), 4, 5, 80),
    ((8,), 4, 4, 80),
    ((None, 6, 6, 13), 2, 7, 90),
    ((1, None), 3, 1, 40),
])
def test_blocks_for_sequence_bounds_what_a_chunked_sequence_holds(windows, block_size, chunk, num_tokens) -> None:
    bm = BlockManager(1000, block_size, windows)
    peak = 0
    computed = 0
    while computed < num_tokens:
        step = min(chunk, num_tokens - computed)
        bm.grow(1, computed + step, computed)
        peak = max(peak, bm.num_used_blocks)
        computed += step
    bound = bm.blocks_for_sequence(num_tokens, chunk)
    assert peak <= bound
    if windows == (8,) and chunk == 5:
        # The chunk of positions 30..34 reads from position 23 on: blocks 5..8, the bound's
        # ceil((8 - 1 + 5) / 4) + 1 = 4.
        assert peak == bound == 4
    if None in windows:
        assert bound >= math.ceil(num_tokens / block_size)


def test_a_sliding_prefix_hits_after_its_first_blocks_are_evicted() -> None:
    tokens = list(range(12))
    hashes = hashes_of(tokens, 4)
    bm = BlockManager(num_blocks=4, block_size=4, group_windows=(6,))
    bm.grow(1, 12)
    first_blocks = list(bm.block_table(1))
    bm.offer_full_blocks(1, hashes, 3)
    bm.grow(1, 13, num_computed=12)  # drops block 0, which returns to the free list before the others
    bm.free(1)
    bm.grow(2, 4)
    assert bm.block_table(2) == first_blocks[:1]  # the prefix's first block is gone
    # Position 12 attends back to 7: blocks 1 and 2 suffice.
    hit = bm.cached_prefix(hashes)
    assert hit == [[DROPPED_BLOCK, *first_blocks[1:3]]]
    assert bm.can_start(13, hit, chunk_tokens=4) and not bm.can_start(17, hit, chunk_tokens=4)
    bm.share(3, hit)
    assert held(bm, 3) == [first_blocks[1:3]] and bm.num_free_blocks == 1
    bm.grow(3, 13, num_computed=12)
    bm.free(3)
    bm.free(2)
    assert_pool_free(bm)


def test_a_hit_needs_every_full_group_and_each_window_group_s_window() -> None:
    bm = BlockManager(num_blocks=3 * 8 + 17, block_size=1, group_windows=(2, None, 4))
    hashes = hashes_of(list(range(8)), 1)
    bm.grow(1, 8)
    short, full, wide = (list(t) for t in bm.block_tables(1))
    bm.offer_full_blocks(1, hashes, 8)
    bm.free(1)  # position 7 of each group first, then 6, ...
    assert bm.cached_prefix(hashes) == [[DROPPED_BLOCK] * 7 + short[7:], full, [DROPPED_BLOCK] * 5 + wide[5:]]
    bm.grow(2, 6)  # 18 blocks: the 17 never used, then the least recently freed, short[7]
    # A hit of 8 needs short[7]; one of 7 needs short[6] and wide[4..6].
    assert bm.cached_prefix(hashes) == [[DROPPED_BLOCK] * 6 + short[6:7], full[:7], [DROPPED_BLOCK] * 4 + wide[4:7]]
    bm.free(2)
    assert_pool_free(bm)


def brute_force_hit(num_blocks: int, windows: tuple, block_size: int, cached: list[set[int]]) -> int:
    """The longest hit k by definition: every block a group's layers read at position k * block_size."""
    for k in range(num_blocks, -1, -1):
        end = k * block_size
        if all(set(blocks_attended(end, end, w, block_size)) <= c for w, c in zip(windows, cached)):
            return k
    raise AssertionError("k = 0 needs no block")


def test_the_longest_hit_is_the_longest_prefix_every_group_can_serve() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        windows = tuple(rng.choice([None, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(1, 4)))
        block_size, num_blocks = rng.choice([1, 2, 4]), rng.randint(0, 14)
        density = rng.choice([0.6, 0.85, 0.95])
        cached = [{i for i in range(num_blocks) if rng.random() < density} for _ in windows]
        expected = brute_force_hit(num_blocks, windows, block_size, cached)
        hit = longest_cache_hit(num_blocks, windows, block_size, lambda g, i, cached=cached: i in cached[g])
        assert hit == expected


@pytest.mark.parametrize(("windows", "evicted"), [((8, None), []), ((None, 8), []), ((8, 8), [1, 0])])
def test_events_describe_the_first_full_group_or_group_0(windows, evicted: list[int]) -> None:
    bm = BlockManager(num_blocks=10, block_size=4, group_windows=windows)
    hashes = hashes_of(list(range(16)), 4)
    bm.take_events()
    bm.grow(1, 17)
    bm.offer_full_blocks(1, hashes, 4)
    assert bm.take_events().stored == hashes  # once each, not once per group
    bm.grow(1, 18, num_computed=17)  # window groups drop blocks 0 and 1, still cached, onto the free list
    bm.grow(2, 4)  # takes two of them: the first window group's blocks of hashes 1 and 0
    assert bm.take_events().removed == [hashes[i] for i in evicted]
    assert bm.cached_hashes() == [h for i, h in enumerate(hashes) if i not in evicted]
    bm.reset_prefix_cache()
    assert bm.take_events().removed == [h for i, h in enumerate(hashes) if i not in evicted]
    assert bm.cached_prefix(hashes) == [[] for _ in windows]


@pytest.mark.parametrize("windows", [(), (0,), (None, -2), (2.5,), ("4",)])
def test_bad_group_windows_are_refused(windows) -> None:
    with pytest.raises(ValueError, match="window|group"):
        BlockManager(8, 4, windows)


def test_bad_arguments_are_refused() -> None:
    bm = BlockManager(8, 4, (None, 4))
    with pytest.raises(ValueError, match="num_computed"):
        bm.grow(1, 4, num_computed=5)
    bm.grow(1, 4)
    with pytest.raises(ValueError, match="num_computed"):
        bm.can_grow(1, 12, num_computed=8)  # the tables cover 4 positions
    with pytest.raises(ValueError, match="2 KV cache groups"):
        bm.share(2, [[]])
    with pytest.raises(ValueError, match="chunk_tokens"):
        bm.blocks_for_sequence(10, 0)


# --- the scheduler over groups -------------------------------------------------------------------

LONG_LAYOUTS = {
    # Gemma 3 1B: 5 sliding layers (window 512) for each global one, 4 layers a group.
    "gemma3": ([None if layer % 6 == 5 else 512 for layer in range(26)], 4),
    # Gemma 2 2B: sliding (window 4096) and global layers alternate.
    "gemma2": ([4096 if layer % 2 == 0 else None for layer in range(26)], 13),
    # Mistral 7B v0.1: every layer slides over 4096 positions.
    "mistral": ([4096] * 32, 32),
}


@pytest.mark.parametrize("layout", LONG_LAYOUTS)
def test_a_long_sequence_holds_only_the_windows_of_its_sliding_layers(layout: str) -> None:
    layer_windows, layers_per_group = LONG_LAYOUTS[layout]
    groups = layer_groups(layer_windows, layers_per_group)
    block_size, budget, max_tokens, total = 16, 512, 64, 8192
    # The smallest pool this sequence fits alone.
    pool = BlockManager(1, block_size, groups).blocks_for_sequence(total, budget)
    s = make_scheduler(pool, block_size, groups, max_num_batched_tokens=budget, max_model_len=total)
    seq = make_seq(total - max_tokens, max_tokens=max_tokens)
    s.check_fits(seq)
    s.add(seq)
    while s.num_unfinished:
        out = s.schedule()
        last_position = seq.num_computed_tokens + out.num_scheduled_tokens[0] - 1
        held_now = held(s.block_manager, seq.seq_id)
        advance(s, out)
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_tokens == total and s.num_preemptions == 0
    assert last_position == total - 2  # the last token sampled is never computed
    for window, blocks in zip(groups, held_now):
        assert len(blocks) == len(blocks_attended(last_position, last_position + 1, window, block_size))
    every_layer = len(layer_windows) * (total // block_size)  # layer-blocks of a cache keeping them all
    held_fraction = sum(map(len, held_now)) * layers_per_group / every_layer
    pool_fraction = pool * layers_per_group / every_layer
    assert held_fraction == pytest.approx({"gemma3": 0.213, "gemma2": 0.751, "mistral": 0.502}[layout], abs=1e-3)
    if layout == "gemma3":
        assert held_fraction <= 0.35 and pool_fraction <= 0.35
    assert_pool_free(s.block_manager)


def test_a_prompt_longer_than_the_pool_runs_when_every_layer_slides() -> None:
    full = make_scheduler(num_blocks=5, block_size=4, group_windows=(None, 8), max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="KV blocks"):
        full.check_fits(make_seq(100))
    s = make_scheduler(num_blocks=5, block_size=4, group_windows=(8,), max_num_batched_tokens=8)
    seq = make_seq(100, max_tokens=20)
    s.check_fits(seq)  # ceil((8 - 1 + 8) / 4) + 1 = 5 blocks at most
    s.add(seq)
    run_checked(s, KVSlots(s))
    assert seq.num_output_tokens == 20 and s.num_preemptions == 0


def test_a_sequence_back_with_its_generated_tokens_computes_them_in_chunks_the_pool_holds() -> None:
    """After preemption (or on another replica) a sequence comes back longer than its prompt: in one
    chunk of the budget its window group would hold all 20 blocks, in chunks of 7 at most 6."""
    s = make_scheduler(num_blocks=6, block_size=2, group_windows=(4,), max_num_batched_tokens=64)
    seq = make_seq(4, max_tokens=40)
    s.check_fits(seq)
    seq.token_ids.extend([7] * 36)
    s.add(seq)
    kv = KVSlots(s)
    out = s.schedule()
    assert out.num_scheduled_tokens == [7]  # ceil((4 - 1 + 7) / 2) + 1 = 6
    assert s.block_manager.largest_fitting_chunk(40, 64) == 7 and s.block_manager.largest_fitting_chunk(40, 5) == 5
    kv.step(out)
    advance(s, out)
    run_checked(s, kv)
    assert seq.num_output_tokens == 40 and s.num_preemptions == 0


def test_a_lone_sequence_outgrowing_the_pool_finishes_with_length_beside_a_window_group() -> None:
    s = make_scheduler(num_blocks=5, block_size=2, group_windows=(None, 2))
    seq = make_seq(3, max_tokens=10)
    s.add(seq)
    run_checked(s, KVSlots(s))
    assert seq.finish_reason is FinishReason.LENGTH
    # Tokens 0..5 fill the full group's 3 blocks, the window group holds 1: the 7th token was
    # sampled from a pool with 1 free block, and its K/V needs one in each group.
    assert seq.num_tokens == 7


def test_reservations_count_what_a_window_group_holds_at_most() -> None:
    s = make_scheduler(num_blocks=14, block_size=2, group_windows=(4,), admission="reserve", max_num_batched_tokens=8)
    seqs = [make_seq(4, max_tokens=20) for _ in range(3)]
    assert s.reservation_blocks(seqs[0]) == 7  # ceil((4 - 1 + 8) / 2) + 1, not the 12 blocks of 24 tokens
    for seq in seqs:
        s.check_fits(seq)
        s.add(seq)
    kv = KVSlots(s)
    out = s.schedule()
    assert out.seqs == seqs[:2] and s.num_reserved_blocks == 14
    kv.step(out)
    advance(s, out)
    run_checked(s, kv)
    assert s.num_preemptions == 0 and s.num_reserved_blocks == 0
    assert all(seq.num_output_tokens == 20 for seq in seqs)


def shared_prompt_seqs(prompt: list[int], count: int, max_tokens: int = 6) -> list[Sequence]:
    return [Sequence(i, f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens), 0.0) for i in range(count)]


@pytest.mark.parametrize("windows", [(None, 5), (5, 9), (None, 5, 5, 13)])
def test_a_repeated_prompt_starts_from_each_group_s_cached_blocks(windows) -> None:
    s = make_scheduler(num_blocks=64, block_size=4, group_windows=windows)
    kv = KVSlots(s)
    prompt = list(range(500, 522))  # 22 tokens: 5 full blocks
    first, second = shared_prompt_seqs(prompt, 2)
    s.add(first)
    run_checked(s, kv)
    s.add(second)
    out = s.schedule()
    assert second.num_computed_tokens == 20 and s.num_prefix_hits == 20
    for window, table in zip(windows, s.block_manager.block_tables(second.seq_id)):
        assert table.count(DROPPED_BLOCK) == (0 if window is None else (20 - window + 1) // 4)
    kv.step(out)
    advance(s, out)
    run_checked(s, kv)
    assert second.token_ids == first.token_ids


@pytest.mark.parametrize("budget", [64, 12])  # 12: the first prompt's blocks complete over several steps
@pytest.mark.parametrize("windows", [(None, 5), (6,)])
def test_prompts_admitted_in_one_step_share_the_blocks_completed_in_it(windows, budget: int) -> None:
    s = make_scheduler(num_blocks=64, block_size=4, group_windows=windows, max_num_batched_tokens=budget)
    seqs = shared_prompt_seqs(list(range(700, 722)), 3)
    for seq in seqs:
        s.add(seq)
    run_checked(s, KVSlots(s))
    assert s.num_prefix_hits == 2 * 20
    assert seqs[1].token_ids == seqs[0].token_ids == seqs[2].token_ids


def test_preemption_under_a_squeezed_pool_with_window_groups() -> None:
    s = make_scheduler(num_blocks=14, block_size=2, group_windows=(None, 3), max_num_seqs=8)
    seqs = [make_seq(5, max_tokens=12) for _ in range(6)]
    for seq in seqs:
        s.add(seq)
    run_checked(s, KVSlots(s))
    assert s.num_preemptions > 0
    assert all(seq.num_output_tokens == 12 for seq in seqs)


LAYOUTS = {
    "llama": (None,),
    "gemma3": (5, 5, None),
    "gemma2": (None, 6),
    "mistral": (6, 6),
    "two windows": (None, 3, 9),
}


@pytest.mark.parametrize("admission", ["preempt", "reserve"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_loads_read_their_own_kv_and_return_every_block(layout: str, admission: str) -> None:
    """Shared prefixes, repeated prompts, chunked prompts, aborts, preemption and eviction."""
    windows = LAYOUTS[layout]
    rng = random.Random(f"{layout}/{admission}")
    num_preemptions = num_prefix_hits = 0
    for _ in range(6):
        s = make_scheduler(
            num_blocks=rng.randint(10, 40), block_size=rng.choice([2, 4]), group_windows=windows,
            max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.choice([6, 16, 64]), admission=admission,
        )
        kv = KVSlots(s)
        prefixes = [[rng.randrange(40) for _ in range(rng.randint(0, 24))] for _ in range(3)]
        pending = []
        for seq_id in range(14):
            prompt = rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randint(1, 12))]
            if pending and rng.random() < 0.25:
                prompt = list(pending[-1].prompt_token_ids)  # a request's n choices
            seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=rng.randint(1, 16)), 0.0)
            try:
                s.check_fits(seq)
            except ValueError:
                continue
            pending.append(seq)
        for _ in range(5000):
            while pending and rng.random() < 0.5:
                s.add(pending.pop(0))
            if not s.num_unfinished and not pending:
                break
            out = s.schedule()
            kv.step(out)
            advance(s, out)
            if rng.random() < 0.05 and s.num_unfinished:
                victim = rng.choice(list(s.running.values()) + list(s.waiting))
                s.finish(victim, FinishReason.ABORT)
        assert not s.num_unfinished and not pending
        assert_pool_free(s.block_manager)
        num_preemptions += s.num_preemptions
        num_prefix_hits += s.num_prefix_hits
    assert num_prefix_hits > 0
    assert (num_preemptions > 0) == (admission == "preempt")
