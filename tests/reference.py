"""Reference computations with transformers, used only by the tests."""

from __future__ import annotations

import torch


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with full forwards: no cache, no generate() defaults in the way."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


def ember_prompt_logits(llm, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position through ember's real paged path (cache write + gather)."""
    from ember_core.runner.inputs import SequenceChunk

    engine = llm.engine
    scratch_seq_id = -1
    engine.block_manager.grow(scratch_seq_id, len(prompt))
    try:
        chunk = SequenceChunk(prompt, 0, engine.block_manager.block_tables(scratch_seq_id))
        with torch.inference_mode():
            hidden = engine.runner.forward_hidden([chunk])
            return engine.runner.model.compute_logits(hidden).float()
    finally:
        engine.block_manager.free(scratch_seq_id)
