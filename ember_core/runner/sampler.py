"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Random rows use the exponential race (argmax of p / Exp(1) noise), which samples exactly from p.
A seeded request draws its noise from a generator keyed by (seed, output index), so its tokens do
not depend on what else is in the batch or on preemption.
"""

from __future__ import annotations

import torch

from ember_core.runner.inputs import SampledToken, SamplingRequest

_SEED_MIX = 0x9E3779B97F4A7C15


def _seeded_noise(seed: int, output_index: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _SEED_MIX + output_index) % (1 << 63))
    return torch.empty(vocab_size, device=device).exponential_(generator=generator)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside the top-k and outside the smallest set whose mass reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, requests: list[SamplingRequest]) -> list[SampledToken]:
    logits = logits.float()
    vocab_size = logits.shape[1]
    device = logits.device
    for row, req in enumerate(requests):
        if req.banned_token_ids:
            logits[row, list(req.banned_token_ids)] = float("-inf")
    token_ids = logits.argmax(dim=-1)
    random_rows = [row for row, req in enumerate(requests) if not req.params.greedy]
    if random_rows:
        params = [requests[row].params for row in random_rows]
        scaled = logits[random_rows] / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        if any(p.top_k or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k or vocab_size for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            scaled = _apply_top_k_top_p(scaled, top_k, top_p)
        noise = torch.empty(len(random_rows), vocab_size, device=device).exponential_()
        for i, row in enumerate(random_rows):
            seed = requests[row].params.seed
            if seed is not None:
                noise[i] = _seeded_noise(seed, requests[row].output_index, vocab_size, device)
        token_ids[random_rows] = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
    return _with_logprobs(logits, token_ids, requests)


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, requests: list[SamplingRequest]) -> list[SampledToken]:
    ids = token_ids.tolist()
    rows = [row for row, req in enumerate(requests) if req.params.logprobs is not None]
    if not rows:
        return [SampledToken(token_id) for token_id in ids]
    logprobs = logits[rows].log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
    num_top = max(requests[row].params.logprobs or 0 for row in rows)
    top_values, top_ids = logprobs.topk(min(num_top, logits.shape[1]), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    result = [SampledToken(token_id) for token_id in ids]
    for i, row in enumerate(rows):
        n = requests[row].params.logprobs or 0
        top = tuple(zip(top_ids[i][:n], top_values[i][:n]))
        result[row] = SampledToken(ids[row], chosen[i], top)
    return result
