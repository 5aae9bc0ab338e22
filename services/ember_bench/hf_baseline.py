"""The transformers baseline: static batches of `concurrency` requests through `generate`, left
padded, each batch running until its longest request is done. Only the tokens the requests asked
for count, so padding and overshoot are cost, not throughput."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ember_bench.offline_runs import EngineSetting, OfflineRun, offline_run
from ember_core.device import resolve_dtype
from ember_core.loaders.resolve import resolve_model

WARMUP_TOKENS = 2


def load_transformers_model(name: str, dtype: str, device: torch.device) -> PreTrainedModel:
    path = resolve_model(name)
    torch_dtype = resolve_dtype(dtype, device)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    return model.to(device).eval()


def run_transformers(
    name: str, dtype: str, device: torch.device, concurrencies: list[int], prompts: list[list[int]],
    max_tokens: list[int],
) -> Iterator[OfflineRun]:
    model = load_transformers_model(name, dtype, device)
    pad_id = _pad_token_id(model)
    _generate(model, [prompts[0]], WARMUP_TOKENS, pad_id)
    setting = EngineSetting(batching="static", dtype=dtype)
    for concurrency in concurrencies:
        latencies: list[float] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), concurrency):
            batch = prompts[first : first + concurrency]
            _generate(model, batch, max(max_tokens[first : first + concurrency]), pad_id)
            latencies += [time.perf_counter() - start] * len(batch)
        duration_s = time.perf_counter() - start
        yield offline_run("transformers", setting, concurrency, latencies, sum(max_tokens), duration_s, None)


@torch.inference_mode()
def _generate(model: PreTrainedModel, batch: list[list[int]], num_tokens: int, pad_id: int) -> None:
    width = max(map(len, batch))
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long, device=model.device)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long, device=model.device)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    # min_new_tokens = max_new_tokens plays ignore_eos: every row runs the full length.
    model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
        do_sample=False, pad_token_id=pad_id,
    )


def _pad_token_id(model: PreTrainedModel) -> int:
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return candidate
    return 0
