"""Penalties and logit_bias, applied to a step's logits before sampling (greedy rows included), as
OpenAI and vLLM define them; rows without them are left untouched."""

from __future__ import annotations

import torch

from ember_core.runner.inputs import SamplingRequest


def apply_penalties_and_bias_(logits: torch.Tensor, requests: list[SamplingRequest]) -> None:
    """logits [rows, vocab] float32, one row per request, changed in place: logit_bias first, then
    the penalties (vLLM's order, so a biased token that was seen is penalised with its bias)."""
    biased = [(row, token, bias) for row, req in enumerate(requests) for token, bias in (req.params.logit_bias or {}).items()]
    if biased:
        row_ids, token_ids, biases = zip(*biased)
        logits.index_put_(
            (torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device)),
            torch.tensor(biases, device=logits.device, dtype=logits.dtype),
            accumulate=True,
        )
    rows = [row for row, req in enumerate(requests) if req.params.needs_token_history]
    if rows:
        _apply_penalties_(logits, rows, [requests[row] for row in rows])


def _apply_penalties_(logits: torch.Tensor, rows: list[int], requests: list[SamplingRequest]) -> None:
    device, vocab_size = logits.device, logits.shape[1]
    output_counts = torch.zeros(len(rows), vocab_size, device=device)
    seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    for i, req in enumerate(requests):
        outputs = torch.tensor(req.output_token_ids or [], dtype=torch.long, device=device)
        output_counts[i].index_add_(0, outputs, torch.ones(len(outputs), device=device))
        seen[i, torch.tensor(req.prompt_token_ids or [], dtype=torch.long, device=device)] = True
    seen |= output_counts > 0
    selected = logits[rows]
    repetition = torch.tensor([req.params.repetition_penalty for req in requests], device=device).unsqueeze(1)
    penalized = torch.where(selected > 0, selected / repetition, selected * repetition)
    selected = torch.where(seen, penalized, selected)
    frequency = torch.tensor([req.params.frequency_penalty for req in requests], device=device).unsqueeze(1)
    presence = torch.tensor([req.params.presence_penalty for req in requests], device=device).unsqueeze(1)
    logits[rows] = selected - frequency * output_counts - presence * (output_counts > 0)
