"""The C++ paged decode-attention kernel against a float64 reference, the KV-cache write against
index_copy_, and the fallback when the extension cannot be built."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from ember_core.kernels import cpu_ops


@dataclass
class Case:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float


def make_case(
    context_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Case:
    """Shuffled, non-contiguous block ids with spare blocks in the pool. Every cache slot outside a
    sequence's context is NaN and table padding is an invalid id, so reading either shows up."""
    generator = torch.Generator().manual_seed(seed)
    held = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(held) + 7
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    max_blocks = max(held) + 2
    tables = []
    for context_len, count in zip(context_lens, held):
        table, block_ids = block_ids[:count], block_ids[count:]
        for cache in (key_cache, value_cache):
            slots = cache[table].flatten(0, 1)
            slots[:context_len] = torch.randn(context_len, num_kv_heads, head_dim, generator=generator).to(dtype)
            cache[table] = slots.view(count, block_size, num_kv_heads, head_dim)
        tables.append(table + [num_blocks + 1000] * (max_blocks - count))
    return Case(
        query=torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def reference(case: Case) -> torch.Tensor:
    """Per sequence: gather its K/V up to context_len, repeat kv heads, softmax(q k^T * scale) v in float64."""
    outputs = []
    group = case.query.shape[1] // case.key_cache.shape[2]
    for b, context_len in enumerate(case.context_lens.tolist()):
        table = case.block_tables[b, : -(-context_len // case.key_cache.shape[1])].long()
        keys = case.key_cache[table].flatten(0, 1)[:context_len].double().repeat_interleave(group, dim=1)
        values = case.value_cache[table].flatten(0, 1)[:context_len].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", case.query[b].double(), keys) * case.scale
        outputs.append(torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values))
    return torch.stack(outputs)


def run_kernel(case: Case) -> torch.Tensor:
    return cpu_ops.paged_decode_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.context_lens, case.scale
    )


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1), (1, 4), (1, 5)], ids=["gqa3", "mha", "mqa4", "mqa5"])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 36])
@pytest.mark.parametrize("block_size", [16, 5])
def test_kernel_matches_reference(
    kernel: None, dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    # One token, exactly one and two full blocks, one past a block, and long mixed contexts.
    context_lens = [1, block_size, 2 * block_size, block_size + 1, 100, 47, 300, 600]
    case = make_case(context_lens, num_kv_heads, group, head_dim, block_size, dtype)
    out = run_kernel(case)
    assert out.dtype == dtype and out.shape == case.query.shape
    torch.testing.assert_close(out.double(), reference(case), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["fp16-cache", "bf16-cache"])
@pytest.mark.parametrize("head_dim", [64, 36])
def test_float32_query_over_a_narrower_cache(kernel: None, cache_dtype: torch.dtype, head_dim: int) -> None:
    """A float32 model with --kv-cache-dtype float16 / bfloat16: the kernel widens K/V as it loads
    them, so the output is the float32 kernel's over the same (rounded) values."""
    case = make_case([1, 16, 17, 100, 300], num_kv_heads=3, group=3, head_dim=head_dim, block_size=16, dtype=cache_dtype)
    case = with_changes(case, query=case.query.float())
    out = run_kernel(case)
    assert out.dtype == torch.float32
    widened = run_kernel(with_changes(case, key_cache=case.key_cache.float(), value_cache=case.value_cache.float()))
    torch.testing.assert_close(out, widened, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=0)


def _windowed(case: Case, window: int) -> Case:
    """The case as a sliding-window layer's block tables hold it: blocks wholly before a sequence's
    window dropped (-1, as the block manager leaves them) and the slots before it NaN, so a read of
    either shows up."""
    block_size = case.key_cache.shape[1]
    key_cache, value_cache, tables = case.key_cache.clone(), case.value_cache.clone(), case.block_tables.clone()
    for b, context_len in enumerate(case.context_lens.tolist()):
        first = max(0, context_len - window)
        for position in range(first):
            block = int(case.block_tables[b, position // block_size])
            key_cache[block, position % block_size] = value_cache[block, position % block_size] = float("nan")
        tables[b, : first // block_size] = -1
    return with_changes(case, key_cache=key_cache, value_cache=value_cache, block_tables=tables)


def windowed_reference(case: Case, window: int, softcap: float) -> torch.Tensor:
    """reference() over each query's last `window` positions, its scores soft-capped first (0: none)."""
    outputs = []
    group = case.query.shape[1] // case.key_cache.shape[2]
    for b, context_len in enumerate(case.context_lens.tolist()):
        table = case.block_tables[b, : -(-context_len // case.key_cache.shape[1])].long().clamp(min=0)
        first = max(0, context_len - window) if window else 0
        keys = case.key_cache[table].flatten(0, 1)[first:context_len].double().repeat_interleave(group, dim=1)
        values = case.value_cache[table].flatten(0, 1)[first:context_len].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", case.query[b].double(), keys) * case.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        outputs.append(torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values))
    return torch.stack(outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("window", "softcap"), [(0, 2.0), (7, 0.0), (100, 0.0), (16, 50.0)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_sliding_windows_and_soft_capped_scores(
    kernel: None, dtype: torch.dtype, window: int, softcap: float, block_size: int
) -> None:
    """Gemma 2's soft-capped logits and the sliding windows of Mistral and Gemma: a query reads only
    its window's blocks, and its output bits are its own, alone or batched."""
    context_lens = [1, 7, 8, block_size + 1, 100, 101, 300, 613]
    case = make_case(context_lens, num_kv_heads=2, group=3, head_dim=64, block_size=block_size, dtype=dtype, seed=3)
    if window:
        case = _windowed(case, window)
    out = cpu_ops.paged_decode_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.context_lens, case.scale, softcap, window
    )
    expected = windowed_reference(case, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype] * (2 if softcap else 1), rtol=0)
    assert not torch.allclose(expected, windowed_reference(case, 0, 0.0).nan_to_num(), atol=TOLERANCE[dtype])
    for b in (0, 5, 7):
        alone = cpu_ops.paged_decode_attention(
            case.query[b : b + 1], case.key_cache, case.value_cache, case.block_tables[b : b + 1],
            case.context_lens[b : b + 1], case.scale, softcap, window,
        )
        assert torch.equal(alone, out[b : b + 1])


def test_supported_dtype_pairs_are_exactly_those_the_kernel_runs(kernel: None) -> None:
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    for query_dtype in dtypes:
        for cache_dtype in dtypes:
            case = make_case([5, 20], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=cache_dtype)
            case = with_changes(case, query=case.query.to(query_dtype))
            try:
                run_kernel(case)
                ran = True
            except RuntimeError:
                ran = False
            assert cpu_ops.decode_attention_supports(query_dtype, cache_dtype) == ran, (query_dtype, cache_dtype)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(
    "context_lens", [[1], [613], [16] * 40, [200, 7, 450, 33]], ids=["one", "long", "many", "mixed"]
)
def test_kernel_is_correct_however_the_work_is_split(kernel: None, num_threads: int, context_lens: list[int]) -> None:
    case = make_case(context_lens, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=1)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = run_kernel(case)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=0)


def _in_blocks_of(case: Case, block_size: int) -> Case:
    """The same sequences' K/V laid out again in blocks of another size."""
    lens = case.context_lens.tolist()
    held = [-(-n // block_size) for n in lens]
    firsts = [sum(held[:b]) for b in range(len(lens))]
    caches = []
    for cache in (case.key_cache, case.value_cache):
        relaid = torch.zeros(sum(held), block_size, *cache.shape[2:], dtype=cache.dtype)
        rows = relaid.flatten(0, 1)
        for b, n in enumerate(lens):
            table = case.block_tables[b, : -(-n // cache.shape[1])].long()
            rows[firsts[b] * block_size : firsts[b] * block_size + n] = cache[table].flatten(0, 1)[:n]
        caches.append(relaid)
    tables = [list(range(first, first + h)) + [0] * (max(held) - h) for first, h in zip(firsts, held)]
    return with_changes(
        case, key_cache=caches[0], value_cache=caches[1], block_tables=torch.tensor(tables, dtype=torch.int32)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_a_sequences_output_bits_depend_on_its_own_query_and_kv_only(
    kernel: None, dtype: torch.dtype, head_dim: int
) -> None:
    """Greedy decoding must not change with batch composition, thread count or block size (the
    engine's invariance), so neither may one bit of a sequence's attention output."""
    lens = [613, 200, 7, 450, 64, 65, 1, 1100]
    case = make_case(lens, num_kv_heads=3, group=3, head_dim=head_dim, block_size=16, dtype=dtype, seed=2)
    batched = run_kernel(case)
    for b in range(len(lens)):
        alone = with_changes(
            case, query=case.query[b : b + 1], block_tables=case.block_tables[b : b + 1],
            context_lens=case.context_lens[b : b + 1],
        )
        assert torch.equal(run_kernel(alone)[0], batched[b]), f"sequence {b} alone"
    for block_size in (1, 5, 64):
        assert torch.equal(run_kernel(_in_blocks_of(case, block_size)), batched), f"blocks of {block_size}"
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(run_kernel(case), batched), "one thread"
    finally:
        torch.set_num_threads(previous)


def test_query_rows_may_be_strided(kernel: None) -> None:
    """The q columns of a fused QKV output: each row's heads contiguous, rows further apart."""
    case = make_case([5, 40, 17], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)
    qkv = torch.cat((case.query.flatten(1), torch.randn(3, 384)), dim=1)
    strided = qkv[:, :576].view(3, 9, 64)
    assert not strided.is_contiguous()
    assert torch.equal(run_kernel(with_changes(case, query=strided)), run_kernel(case))


def test_zero_length_context_gives_zeros(kernel: None) -> None:
    case = make_case([5, 20], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)
    case.context_lens[1] = 0
    out = run_kernel(case)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0].double(), reference(case)[0], atol=1e-5, rtol=0)


def test_empty_batch(kernel: None) -> None:
    case = make_case([5], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)
    out = cpu_ops.paged_decode_attention(
        case.query[:0], case.key_cache, case.value_cache, case.block_tables[:0], case.context_lens[:0], case.scale
    )
    assert out.shape == (0, 9, 64)


def with_changes(case: Case, **changes: object) -> Case:
    return Case(**{**case.__dict__, **changes})


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: with_changes(c, query=c.query.double()), "got a Double query over a Float cache"),
        (lambda c: with_changes(c, query=c.query.bfloat16()), "got a BFloat16 query over a Float cache"),
        (lambda c: with_changes(c, value_cache=c.value_cache.half()), "must share a dtype"),
        (lambda c: with_changes(c, block_tables=c.block_tables.long()), "int32"),
        (lambda c: with_changes(c, context_lens=c.context_lens.long()), "int32"),
        (lambda c: with_changes(c, query=c.query.transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        (lambda c: with_changes(c, query=c.query[:, :8].contiguous()), "not a multiple"),
        (lambda c: with_changes(c, query=c.query[..., :32].contiguous()), "head_dim"),
        (lambda c: with_changes(c, context_lens=c.context_lens + 1000), "does not fit"),
        (lambda c: with_changes(c, block_tables=c.block_tables.clone().fill_(10**6)), "outside the cache"),
        (lambda c: with_changes(c, block_tables=c.block_tables[:1]), r"\[batch, max_blocks\]"),
    ],
    ids=[
        "fp64",
        "bf16-query-fp32-cache",
        "mixed-caches",
        "int64-tables",
        "int64-lens",
        "strided-query",
        "heads",
        "head-dim",
        "too-long",
        "bad-block",
        "table-rows",
    ],
)
def test_unsupported_inputs_raise_a_clear_error(kernel: None, change, message: str) -> None:
    case = change(make_case([5, 20], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32))
    with pytest.raises(RuntimeError, match=message):
        run_kernel(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_cache_fills_the_slots_index_copy_would(kernel: None, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (6, 4, 3, 8)  # num_blocks, block_size, kv_heads, head_dim
    key_cache, value_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    qkv = torch.randn(5, 9 * 8 + 2 * 3 * 8, generator=generator).to(dtype)
    key, value = (qkv[:, 72 + i * 24 : 96 + i * 24].view(5, 3, 8) for i in range(2))  # strided rows
    slots = torch.tensor([23, 0, 7, 8, 16])
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    expected_keys.view(-1, 3, 8).index_copy_(0, slots, key)
    expected_values.view(-1, 3, 8).index_copy_(0, slots, value)
    cpu_ops.ops().write_kv_cache_(key_cache, value_cache, slots, key, value)
    assert torch.equal(key_cache, expected_keys) and torch.equal(value_cache, expected_values)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_write_kv_cache_rounds_float32_rows_into_a_narrower_cache(kernel: None, cache_dtype: torch.dtype) -> None:
    shape = (6, 4, 3, 8)
    key_cache, value_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    qkv = torch.randn(5, 9 * 8 + 2 * 3 * 8, generator=torch.Generator().manual_seed(0)) * 300  # some past fp16's precision
    key, value = (qkv[:, 72 + i * 24 : 96 + i * 24].view(5, 3, 8) for i in range(2))
    slots = torch.tensor([23, 0, 7, 8, 16])
    cpu_ops.ops().write_kv_cache_(key_cache, value_cache, slots, key, value)
    assert torch.equal(key_cache.view(-1, 3, 8)[slots], key.to(cache_dtype))
    assert torch.equal(value_cache.view(-1, 3, 8)[slots], value.to(cache_dtype))
    assert int((key_cache != 0).sum()) == key.numel()  # nothing but those slots


@pytest.mark.parametrize(
    "slots,rows,message",
    [
        (torch.tensor([0, 24]), torch.ones(2, 3, 8), "slot_mapping\\[1\\] = 24 is outside the cache's 24 slots"),
        (torch.tensor([0, -1]), torch.ones(2, 3, 8), "is outside"),
        (torch.tensor([0, 1], dtype=torch.int32), torch.ones(2, 3, 8), "int64"),
        (torch.tensor([0]), torch.ones(2, 3, 8), "one slot per token"),
        (torch.tensor([0, 1]), torch.ones(2, 3, 4), "must be \\[tokens, 3, 8\\]"),
        (torch.tensor([0, 1]), torch.ones(2, 8, 3).transpose(1, 2), "heads must be contiguous"),
        (torch.tensor([0, 1]), torch.ones(2, 3, 8, dtype=torch.float64), "dtype"),
        (torch.tensor([0, 1]), torch.ones(2, 3, 8, dtype=torch.bfloat16), "dtype"),
    ],
    ids=["past-end", "negative", "int32", "count", "shape", "strided-heads", "dtype", "bf16-into-fp32"],
)
def test_write_kv_cache_rejects_what_it_cannot_write(kernel: None, slots, rows, message: str) -> None:
    key_cache, value_cache = torch.zeros(6, 4, 3, 8), torch.zeros(6, 4, 3, 8)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.ops().write_kv_cache_(key_cache, value_cache, slots, rows, rows)
    assert not key_cache.any() and not value_cache.any()  # nothing written before the error


def test_op_traces_under_torch_compile(kernel: None) -> None:
    case = make_case([3, 40, 17], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)

    paged_decode_attention = cpu_ops.ops().paged_decode_attention  # the op itself: what a compiled model calls

    def attend(query: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention(query * 1.0, case.key_cache, case.value_cache, block_tables, context_lens, case.scale)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True, dynamic=True)
    out = compiled(case.query, case.block_tables, case.context_lens)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=0)


def test_unbuildable_extension_falls_back_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[int] = []

    def broken_build(isa: cpu_ops.InstructionSet) -> None:
        attempts.append(1)
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(cpu_ops, "_build", broken_build)
    # A fresh memo of the build attempt, as in a process that has not tried yet.
    monkeypatch.setattr(cpu_ops, "_load", functools.cache(cpu_ops._load.__wrapped__))
    case = make_case([5], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)

    assert not cpu_ops.is_available()
    assert "no C++ compiler found" in cpu_ops.unavailable_reason()
    with pytest.raises(cpu_ops.KernelUnavailableError, match="could not be built: OSError: no C"):
        run_kernel(case)
    assert not cpu_ops.is_available()
    assert attempts == [1]  # remembered, not retried per call


def test_a_build_lock_left_by_a_killed_build_does_not_stop_the_next_load(kernel) -> None:
    """torch leaves its lock file behind when a build is killed; the next load must not wait on it."""
    stale = cpu_ops.build_directory() / "lock"
    stale.touch()
    check = "from ember_core.kernels import cpu_ops; assert cpu_ops.is_available(), cpu_ops.unavailable_reason()"
    environment = {**os.environ, cpu_ops.ISA_ENVIRONMENT_VARIABLE: cpu_ops.active_instruction_set().name}
    subprocess.run([sys.executable, "-c", check], check=True, timeout=300, env=environment)
    assert not stale.exists()
