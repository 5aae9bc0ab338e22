"""The KV memory a long sequence of a Gemma 3-layout model takes in the real engine: 26 layers, five
sliding (window 512) for each global one, an 8,192-token sequence served from the smallest pool
that fits it, against a cache that keeps every layer's K/V of every position."""

from __future__ import annotations

from pathlib import Path

import torch

from ember_core import LLM, SamplingParams
from ember_core.cache import BlockManager
from tests.families import write_checkpoint

LAYERS, WINDOW, TOTAL, BLOCK_SIZE, CHUNK = 26, 512, 8192, 16, 512


def test_an_8k_gemma3_sequence_needs_a_fifth_of_a_full_cache(tmp_path: Path) -> None:
    layer_types = ["full_attention" if layer % 6 == 5 else "sliding_attention" for layer in range(LAYERS)]
    write_checkpoint("gemma3", tmp_path / "gemma3", num_hidden_layers=LAYERS, layer_types=layer_types,
                     sliding_window=WINDOW, max_position_embeddings=TOTAL)
    probe = LLM(str(tmp_path / "gemma3"), dtype="float32", block_size=BLOCK_SIZE, num_blocks=1)
    groups = probe.engine.block_manager.group_windows
    layers_per_group = probe.engine.runner.layout.layers_per_group
    smallest = BlockManager(1, BLOCK_SIZE, groups).blocks_for_sequence(TOTAL, CHUNK)
    del probe

    llm = LLM(str(tmp_path / "gemma3"), dtype="float32", block_size=BLOCK_SIZE, num_blocks=smallest,
              max_num_batched_tokens=CHUNK)
    assert llm.engine.max_model_len == TOTAL
    prompt = torch.randint(3, 300, (TOTAL - 16,), generator=torch.Generator().manual_seed(0)).tolist()
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 16 and llm.engine.stats().num_preemptions == 0
    # Layer-blocks of the pool (every group's tensors, the unused ones of a short last group included)
    # against those of a cache holding each of the 26 layers' K/V at every position.
    fraction = smallest * layers_per_group / (LAYERS * TOTAL // BLOCK_SIZE)
    print(f"\n8k Gemma 3-layout sequence: {smallest} blocks of {len(groups)} groups x {layers_per_group} layers, "
          f"{fraction:.3f}x a full cache")
    assert fraction <= 0.35
