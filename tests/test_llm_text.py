"""LLM.generate's text: stop strings, stop tokens and min_tokens by vLLM's rules, as the gateway applies them."""

from __future__ import annotations

import pytest

from ember_core import LLM, SamplingParams
from tests.conftest import assert_pool_free

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu")


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
