"""Under the fast numerics a request's logprobs are a function of its own tokens: the same bits alone,
batched with prompts of other lengths and with other requests' decodes, in prefill chunks of any
size, on a prefix-cache hit, after preemption and recompute, and with n-gram speculation; in float32
and bfloat16, on every instruction set's build this CPU runs. A llama-quantize Q4_K_M file (dense)
and a mixture of experts' one (tests/core/data/kquants)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_core import LLM, SamplingParams
from ember_core.speculative_config import SpeculativeConfig
from tests.conftest import assert_pool_free
from tests.core.test_kernels import kernel  # noqa: F401 - the fixture that builds the extension or skips
from tests.families import VOCAB

KQUANTS = Path(__file__).parent / "data" / "kquants"
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)
# Drafts at every step (disable_by_batch_size above the batch): every decode verifies some.
ALWAYS_DRAFT = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, disable_by_batch_size=64)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (150, 9, 61, 300, 33)]
    prompts[2] = (prompts[2][:12] * 6)[:61]  # repeats: the n-gram proposer finds drafts
    return prompts


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[tuple]:
    return [(o.token_ids, [(t.token_id, t.logprob, t.top_logprobs) for t in o.logprobs]) for o in llm.generate(prompts, params)]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["llama-Q4_K_M", "qwen3_moe-Q4_K_M"])
def test_logprobs_do_not_depend_on_what_else_the_engine_runs(model: str, dtype: str) -> None:
    path, prompts = str(KQUANTS / f"{model}.gguf"), _prompts()
    settings = dict(device="cpu", dtype=dtype, numerics="fast", block_size=16, num_blocks=512)
    llm = LLM(path, **settings)
    assert llm.engine.loaded.numerics == "fast"
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
        assert _outputs(chunked, prompts) == alone, f"in chunks of {max_num_batched_tokens}"
    # Blocks of 4 tokens, 20 of them: each of three short prompts fits alone with its output, no two together.
    squeezed = LLM(path, **{**settings, "block_size": 4, "num_blocks": 20})
    short = [1, 2, 4]
    assert _outputs(squeezed, [prompts[i] for i in short]) == [alone[i] for i in short], "preempted"
    assert squeezed.stats().num_preemptions > 0
    speculating = LLM(path, speculative_config=ALWAYS_DRAFT, **settings)
    assert _outputs(speculating, prompts) == alone and speculating.stats().spec_num_drafts > 0, "speculating"
    seeded_alone = [_outputs(llm, [prompts[i]], SEEDED)[0] for i in short]
    assert _outputs(squeezed, [prompts[i] for i in short], SEEDED) == seeded_alone, "seeded samples, preempted"
    for engine in (llm, squeezed, speculating):
        assert_pool_free(engine)
