"""A request's logprobs are a function of its own tokens: the same bits alone, batched with prompts
of other lengths and with other requests' decodes, in prefill chunks of any size, on a prefix-cache
hit, after preemption and recompute, with n-gram speculation, and on another engine; seeded samples
alike. In float32 and bfloat16, under both numerics, on every instruction set's build this CPU runs:
llama-quantize Q4_K_M files (a dense model and a mixture of experts, tests/core/data/kquants),
Hugging Face checkpoints of several families, and the default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_core import LLM, SamplingParams
from ember_core.speculative_config import SpeculativeConfig
from tests.conftest import assert_pool_free, write_gpt2_checkpoint
from tests.families import VOCAB, write_checkpoint

KQUANTS = Path(__file__).parents[1] / "data" / "kquants"
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)
# Drafts at every step (disable_by_batch_size above the batch): every decode verifies some.
ALWAYS_DRAFT = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, disable_by_batch_size=64)
# (model, numerics): GGUF files under either numerics; in exact, GPT-2 and checkpoints with the
# families' switches (gemma2: soft-caps and sliding windows beside full layers; qwen3_moe: experts
# and q/k norms). Qwen3-MoE's window, which every layer takes, is turned off: there a sequence never
# holds more than a window's blocks, and the squeezed pool below would have nothing to preempt.
MODELS = [
    ("llama-Q4_K_M", "fast"), ("qwen3_moe-Q4_K_M", "fast"), ("llama-Q4_K_M", "exact"),
    ("hf-gpt2", "exact"), ("hf-llama", "exact"), ("hf-gemma2", "exact"), ("hf-qwen3_moe", "exact"),
]  # fmt: skip


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (150, 9, 61, 300, 33)]
    prompts[2] = (prompts[2][:12] * 6)[:61]  # repeats: the n-gram proposer finds drafts
    return prompts


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[tuple]:
    return [(o.token_ids, [(t.token_id, t.logprob, t.top_logprobs) for t in o.logprobs]) for o in llm.generate(prompts, params)]


def _model_path(model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    if model == "hf-gpt2":  # LayerNorm and learned positions: models/gpt2.py, not the shared decoder
        return str(write_gpt2_checkpoint(tmp_path_factory.mktemp(model), n_positions=512))
    if model.startswith("hf-"):
        directory = tmp_path_factory.mktemp(model)
        family = model.removeprefix("hf-")
        write_checkpoint(family, directory, **({"use_sliding_window": False} if family == "qwen3_moe" else {}))
        return str(directory)
    return str(KQUANTS / f"{model}.gguf")


def assert_logprobs_do_not_depend_on_what_else_runs(path: str, prompts: list[list[int]], **settings) -> None:
    llm = LLM(path, **settings)
    alone = []
    for prompt in prompts:
        llm.reset_prefix_cache()
        alone.append(_outputs(llm, [prompt])[0])
    assert _outputs(llm, prompts) == alone, "batched, on prefix-cache hits"
    llm.reset_prefix_cache()
    assert _outputs(llm, prompts[::-1])[::-1] == alone, "batched"
    # Decodes of the first requests share steps with the prompts of the later ones.
    for request_id, prompt in enumerate(prompts):
        llm.engine.add_request(f"mixed-{request_id}", prompt, PARAMS)
        llm.engine.step()
    while llm.engine.has_unfinished():
        llm.engine.step()
    for max_num_batched_tokens in (37, 200):
        chunked = LLM(path, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=3, **settings)
        assert _outputs(chunked, prompts) == alone, f"in chunks of {max_num_batched_tokens}, on another engine"
    # Blocks of 4 tokens: the longest of three short prompts fits alone with its output, the three
    # together do not. Windowed layers (a second KV cache group) hold a few blocks per sequence beside
    # the full layers' own, so there the pool is wider (72 tokens a sequence) and six requests share it.
    groups = len(llm.engine.runner.layout.group_windows)
    squeezed = LLM(path, **{**settings, "block_size": 4, "num_blocks": 20 if groups == 1 else 36})
    short = [1, 2, 4] * groups
    assert _outputs(squeezed, [prompts[i] for i in short]) == [alone[i] for i in short], "preempted"
    assert squeezed.stats().num_preemptions > 0
    speculating = LLM(path, speculative_config=ALWAYS_DRAFT, **settings)
    assert _outputs(speculating, prompts) == alone and speculating.stats().spec_num_drafts > 0, "speculating"
    seeded_alone = [_outputs(llm, [prompts[i]], SEEDED)[0] for i in short]
    assert _outputs(squeezed, [prompts[i] for i in short], SEEDED) == seeded_alone, "seeded samples, preempted"
    for engine in (llm, squeezed, speculating):
        assert_pool_free(engine)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("model", "numerics"), MODELS, ids=lambda value: value)
def test_logprobs_do_not_depend_on_what_else_the_engine_runs(
    model: str, numerics: str, dtype: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = dict(device="cpu", dtype=dtype, numerics=numerics, block_size=16, num_blocks=512)
    assert_logprobs_do_not_depend_on_what_else_runs(_model_path(model, tmp_path_factory), _prompts(VOCAB), **settings)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_models_logprobs_do_not_depend_on_what_else_the_engine_runs(smollm2_gguf_path: Path, dtype: str) -> None:
    """SmolLM2-135M Q4_1 under its default (fast) numerics, on the build the engine picks."""
    settings = dict(device="cpu", dtype=dtype, block_size=16, num_blocks=512)
    assert_logprobs_do_not_depend_on_what_else_runs(str(smollm2_gguf_path), _prompts(VOCAB), **settings)
