"""LLM.generate's text: stop strings, stop tokens and min_tokens by vLLM's rules, as the gateway applies them."""

from __future__ import annotations

import pytest

from ember_core import LLM, CompletionOutput, RequestOutput, SamplingParams
from tests.conftest import assert_pool_free

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", numerics="exact")  # the default model's exact text


@pytest.fixture(scope="module")
def full(llm: LLM):
    """Greedy: ' Paris.\\n\\nThe answer is: 201' in 12 tokens."""
    return llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]


def greedy(llm: LLM, **params):
    return llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, **params))[0]


def test_a_stop_string_ends_the_text_before_it_and_frees_the_request(llm: LLM, full) -> None:
    out = greedy(llm, stop=["answer", "zzz"])
    assert out.text == full.text[: full.text.index("answer")] and out.finish_reason == "stop"
    # The token that completed the stop string is the last one kept.
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and llm.tokenizer.decode(out.token_ids[-1:]) == " answer"
    assert_pool_free(llm)
    assert greedy(llm, stop="answer", include_stop_str_in_output=True).text == full.text[: full.text.index("answer") + 6]


def test_stop_strings_count_only_from_min_tokens_on(llm: LLM, full) -> None:
    # "\n" comes with tokens 3 and 4 and never again.
    assert greedy(llm, stop="\n").text == " Paris."
    out = greedy(llm, stop="\n", min_tokens=5)
    assert out.text == full.text and out.finish_reason == "length"
    assert greedy(llm, stop="\n", min_tokens=4).text == " Paris.\n"


def test_the_stop_token_that_ended_the_output_gives_no_text_unless_included(llm: LLM) -> None:
    period = llm.tokenizer.encode(".")[0]
    out = greedy(llm, stop_token_ids=[period])
    assert out.text == " Paris" and out.finish_reason == "stop" and len(out.token_ids) == 2
    assert greedy(llm, stop_token_ids=[period], include_stop_str_in_output=True).text == " Paris."


def test_stop_strings_are_validated() -> None:
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop=["ok", ""])
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.mark.parametrize("prompts", [None, {"prompt_token_ids": [1, 2]}, [{"prompt": "hi"}], [[1, "2"]], [[1.5]], 7])
def test_a_prompt_of_the_wrong_type_is_a_type_error_that_leaves_the_engine_free(llm: LLM, prompts) -> None:
    with pytest.raises(TypeError, match="prompt"):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert_pool_free(llm)


def test_outputs_have_vllms_shape(llm: LLM, full) -> None:
    assert isinstance(full, RequestOutput) and full.finished and len(full.outputs) == 1
    completion = full.outputs[0]
    assert isinstance(completion, CompletionOutput)
    assert completion.index == 0 and completion.text == full.text == " Paris.\n\nThe answer is: 201"
    assert completion.token_ids == full.token_ids and completion.finish_reason == full.finish_reason == "length"


def test_n_completions_of_a_prompt_are_seeded_as_the_gateways(llm: LLM) -> None:
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "logprobs": 1, "prompt_logprobs": 1}
    out = llm.generate(PROMPT, SamplingParams(n=3, **params))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert all(len(c.token_ids) == 8 and len(c.logprobs) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seed + i: the completions differ
    # completion i is the request with seed + i and n=1; the prompt's logprobs are computed once
    for completion in out.outputs:
        single = llm.generate(PROMPT, SamplingParams(**{**params, "seed": 7 + completion.index}))[0]
        assert single.token_ids == completion.token_ids and single.text == completion.text
        assert single.prompt_logprobs == out.prompt_logprobs
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) - 1
    assert_pool_free(llm)


@pytest.mark.parametrize("n", [0, 1.5, True])
def test_n_must_be_a_positive_integer(n) -> None:
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\]"):
        SamplingParams(n=n)
