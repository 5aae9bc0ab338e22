"""Decode-attention candidates timed on SmolLM2-135M shapes: `python -m ember_bench.kernel_attention`.

A step is one call per layer, each layer with its own K/V cache, so the K/V come from memory as
they do in a real decode step (one layer's cache would stay hot in L2/L3). Candidates run in
rotation inside every repeat so that load from other processes hits them all alike. Each
candidate's output is checked against gather+SDPA (the largest absolute difference is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from ember_core.kernels import cpu_ops
from ember_core.layers.attention import gathered_decode_attention
from ember_core.layers.flex_decode import decode_block_mask, flex_decode_attention
from ember_core.layers.kv_quant import is_quantized, quantize

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


@dataclass
class StepInputs:
    query: torch.Tensor  # [B, H, D]
    key_caches: list[torch.Tensor]  # one per layer
    value_caches: list[torch.Tensor]
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0, as the runner builds it
    key_mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size]
    block_tables_int32: torch.Tensor
    context_lens: torch.Tensor  # [B] int32


def make_inputs(batch: int, dtype: torch.dtype, num_layers: int, min_context: int, max_context: int) -> StepInputs:
    generator = torch.Generator().manual_seed(batch)
    context_lens = torch.randint(min_context, max_context + 1, (batch,), generator=generator)
    blocks_held = (context_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    max_blocks = int(blocks_held.max())
    num_blocks = int(blocks_held.sum()) + 1
    block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # block 0 is the pad
    tables = []
    for held in blocks_held.tolist():
        tables.append(block_ids[:held] + [0] * (max_blocks - held))
        block_ids = block_ids[held:]
    block_tables = torch.tensor(tables, dtype=torch.long)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    def cache() -> torch.Tensor:  # an 8-bit dtype: random values quantized (layers/kv_quant.py)
        values = torch.randn(shape, generator=generator)
        return quantize(values, dtype) if is_quantized(dtype) else values.to(dtype)

    key_mask = torch.arange(max_blocks * BLOCK_SIZE).unsqueeze(0) < context_lens.unsqueeze(1)
    return StepInputs(
        query=torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator).to(torch.float32 if is_quantized(dtype) else dtype),
        key_caches=[cache() for _ in range(num_layers)],
        value_caches=[cache() for _ in range(num_layers)],
        block_tables=block_tables,
        key_mask=key_mask.view(batch, 1, 1, -1),
        block_tables_int32=block_tables.int(),
        context_lens=context_lens.int(),
    )


def per_sequence_sdpa(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
) -> torch.Tensor:
    """No padding and no mask: each sequence gathers only its own blocks, one SDPA call each."""
    out = torch.empty_like(query)
    for b, context_len in enumerate(context_lens):
        held = (context_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        keys = key_cache[block_tables[b, :held]].flatten(0, 1)[:context_len].transpose(0, 1)
        values = value_cache[block_tables[b, :held]].flatten(0, 1)[:context_len].transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(
            query[b].unsqueeze(1), keys, values, scale=SCALE, enable_gqa=True
        ).squeeze(1)
    return out


StepFn = Callable[[StepInputs, int], torch.Tensor]  # (inputs, layer) -> output


def candidates(compiled_gather_sdpa: Callable | None, flex_block_mask: BlockMask | None, per_sequence: bool) -> dict[str, StepFn]:
    found: dict[str, StepFn] = {
        "gather+SDPA": lambda s, i: gathered_decode_attention(
            s.query, s.key_caches[i], s.value_caches[i], s.block_tables, s.key_mask, SCALE
        ),
    }
    if per_sequence:
        found["per-seq SDPA"] = lambda s, i: per_sequence_sdpa(
            s.query, s.key_caches[i], s.value_caches[i], s.block_tables, s.context_lens.tolist()
        )
    if compiled_gather_sdpa is not None:
        found["compiled gather+SDPA"] = lambda s, i: compiled_gather_sdpa(
            s.query, s.key_caches[i], s.value_caches[i], s.block_tables, s.key_mask, SCALE
        )
    if flex_block_mask is not None:
        found["FlexAttention"] = lambda s, i: flex_decode_attention(
            s.query, s.key_caches[i], s.value_caches[i], flex_block_mask, SCALE
        )
    if cpu_ops.is_available():
        found["C++ kernel"] = lambda s, i: cpu_ops.paged_decode_attention(
            s.query, s.key_caches[i], s.value_caches[i], s.block_tables_int32, s.context_lens, SCALE
        )
    return found


def time_steps(fns: dict[str, StepFn], inputs: StepInputs, num_layers: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of one step (num_layers calls) per candidate and repeat; the first round is warm-up."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for repeat in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            for layer in range(num_layers):
                fn(inputs, layer)
            if repeat:
                samples[name].append(time.perf_counter() - start)
    return samples


def first_call_seconds(compiled: Callable, inputs: StepInputs) -> float:
    start = time.perf_counter()
    compiled(inputs.query, inputs.key_caches[0], inputs.value_caches[0], inputs.block_tables, inputs.key_mask, SCALE)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--min-context", type=int, default=100)
    parser.add_argument("--max-context", type=int, default=400)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile and FlexAttention candidates")
    parser.add_argument("--per-sequence", action="store_true", help="add one SDPA call per sequence (slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    available = cpu_ops.is_available()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    print(
        f"C++ kernel: {'built/loaded' if available else cpu_ops.unavailable_reason()} in {time.perf_counter() - start:.1f} s"
    )
    print(f"{args.layers} layers, contexts uniform in [{args.min_context}, {args.max_context}], {args.repeats} repeats")
    print()
    print(
        "| dtype | batch | mean ctx | candidate | per layer median (us) | per layer min (us) "
        "| per step median (ms) | speed-up vs gather+SDPA | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    compile_seconds: list[str] = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        compiled = None if args.no_compile else torch.compile(gathered_decode_attention, dynamic=True)
        for batch in args.batches:
            inputs = make_inputs(batch, dtype, args.layers, args.min_context, args.max_context)
            if compiled is not None:
                compile_seconds.append(f"{dtype_name} batch {batch}: {first_call_seconds(compiled, inputs):.1f} s")
            flex_mask = None
            if not args.no_compile:
                num_blocks = inputs.key_caches[0].shape[0]
                flex_mask = decode_block_mask(inputs.block_tables_int32, inputs.context_lens, num_blocks, BLOCK_SIZE)
            fns = candidates(compiled, flex_mask, args.per_sequence)
            expected = fns["gather+SDPA"](inputs, 0).float()
            differences = {name: (fn(inputs, 0).float() - expected).abs().max().item() for name, fn in fns.items()}
            samples = time_steps(fns, inputs, args.layers, args.repeats)
            baseline = statistics.median(samples["gather+SDPA"])
            mean_context = inputs.context_lens.float().mean().item()
            for name, steps in samples.items():
                step = statistics.median(steps)
                print(
                    f"| {dtype_name} | {batch} | {mean_context:.0f} | {name} | {step / args.layers * 1e6:.0f} "
                    f"| {min(steps) / args.layers * 1e6:.0f} | {step * 1e3:.1f} | {baseline / step:.1f}x "
                    f"| {differences[name]:.1e} |",
                    flush=True,
                )
    if compile_seconds:
        print("\nfirst call of the compiled candidate (compile or recompile):", "; ".join(compile_seconds))
    print(f"\nload average at end {os.getloadavg()}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
