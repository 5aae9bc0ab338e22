"""`ember bench fidelity`: how far a numerics mode (or dtype) moves a model's next-token
distributions from the float32 computation on the same weights (a GGUF file's blocks widened
exactly: `--numerics exact` in float32); or, with `--kv-cache-dtype`, how far an 8-bit KV cache
moves them from the same computation over a cache in the model's dtype.

The protocol is llama-perplexity's `--kl-divergence`, so the two tools' figures compare: the text
(workloads/fidelity.txt unless told) is cut into windows of `context` tokens, each run from an
empty cache (its first token replaced by BOS where the tokenizer adds one, as llama-perplexity
does), and the positions of each window's second half are scored: per position the KL
divergence KL(reference || tested) of the next-token distributions (nats), whether both put the
same token first, and each model's perplexity of the text.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ember_bench.stats import Distribution
from ember_core.runner.inputs import SequenceChunk
from ember_core.runner.model_runner import ModelRunner

TEXT = Path(__file__).with_name("workloads") / "fidelity.txt"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Fidelity:
    scored_tokens: int
    kl: Distribution  # per scored position, nats
    kl_mean_error: float  # the standard error of kl.mean, as llama-perplexity's "±"
    kl_max: float
    top1_agreement: float  # share of positions where both distributions put the same token first
    top1_error: float  # its standard error
    reference_perplexity: float
    perplexity: float


@torch.inference_mode()
def window_logits(model: nn.Module, tokens: list[int], first: int, kv_cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """float32 logits at positions first .. len(tokens) - 1 of one forward over `tokens` from an
    empty cache (of the model's dtype unless told), [len(tokens) - first, vocab]."""
    runner = ModelRunner(model, -(-len(tokens) // BLOCK_SIZE), BLOCK_SIZE, kv_cache_dtype)
    table = list(range(runner.num_blocks))
    tables = [table] * len(runner.layout.group_windows)  # the same blocks of each group's own pool
    hidden = runner.forward_hidden([SequenceChunk(tokens, 0, tables)])
    return model.compute_logits(hidden[first:]).float()


def windows(tokens: list[int], context: int, max_windows: int | None = None, bos: int | None = None) -> Iterator[list[int]]:
    count = len(tokens) // context if max_windows is None else min(len(tokens) // context, max_windows)
    if count == 0:
        raise ValueError(f"the text has {len(tokens)} tokens: fewer than one window of {context}")
    for start in range(0, count * context, context):
        window = tokens[start : start + context]
        yield window if bos is None else [bos, *window[1:]]


def compare(
    reference: nn.Module, tested: nn.Module, tokens: list[int], context: int, max_windows: int | None = None,
    bos: int | None = None, kv_cache_dtype: torch.dtype | None = None,
) -> Fidelity:
    """Score `tested` (over a KV cache of kv_cache_dtype, if given) against `reference` on every
    window's second half (the token after each position); `bos`: the id each window starts with,
    where the tokenizer adds one."""
    kls, agree, reference_nll, nll = [], 0, 0.0, 0.0
    first = context // 2
    for window in windows(tokens, context, max_windows, bos):
        # the last position predicts a token past the window: not scored
        ref = window_logits(reference, window, first)[:-1].log_softmax(-1)
        out = window_logits(tested, window, first, kv_cache_dtype)[:-1].log_softmax(-1)
        following = torch.tensor(window[first + 1 :])
        kls += (ref.exp() * (ref - out)).sum(-1).tolist()
        agree += int((ref.argmax(-1) == out.argmax(-1)).sum())
        reference_nll -= float(ref.gather(1, following[:, None]).sum())
        nll -= float(out.gather(1, following[:, None]).sum())
    scored, top1 = len(kls), agree / len(kls)
    return Fidelity(
        scored_tokens=scored,
        kl=Distribution.of(kls),
        kl_mean_error=statistics.stdev(kls) / math.sqrt(scored) if scored > 1 else 0.0,
        kl_max=max(kls),
        top1_agreement=top1,
        top1_error=math.sqrt(top1 * (1 - top1) / scored),
        reference_perplexity=math.exp(reference_nll / len(kls)),
        perplexity=math.exp(nll / len(kls)),
    )


def fidelity_row(name: str, fidelity: Fidelity) -> str:
    return (
        f"| {name} | {fidelity.scored_tokens} | {fidelity.kl.mean:.6f} ± {fidelity.kl_mean_error:.6f} | {fidelity.kl.p99:.6f} "
        f"| {fidelity.kl_max:.4f} | {fidelity.top1_agreement:.2%} ± {fidelity.top1_error:.2%} "
        f"| {fidelity.reference_perplexity:.4f} | {fidelity.perplexity:.4f} |"
    )


FIDELITY_HEADER = (
    "| computation | scored tokens | mean KL | p99 KL | max KL | same top-1 | PPL reference | PPL |\n"
    "|---|---|---|---|---|---|---|---|"
)
