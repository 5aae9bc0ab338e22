"""The output processor LLM.generate and the gateway share, and the one table of sampling limits
that the gateway's schemas and SamplingParams both check."""

from __future__ import annotations

import msgspec
import pytest

from ember_core.output_processor import ChoiceResult, OutputProcessor, fan_out
from ember_core.sampling_params import FIELD_LIMITS, SamplingParamError, SamplingParams
from ember_core.tokenizer import Tokenizer
from ember_gateway.api.request_bodies import CompletionRequest
from ember_proto import FinishReason, RequestDelta
from tests.gateway.fake_engine import byte_tokenizer_spec

EOS = 256


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_spec(byte_tokenizer_spec())


def delta(text: str | list[int], finish: FinishReason | None = None) -> RequestDelta:
    ids = list(text.encode()) if isinstance(text, str) else text
    return RequestDelta(request_id="r", new_token_ids=ids, num_prompt_tokens=1, finish_reason=finish)


def test_fan_out_orders_choices_prompt_by_prompt_with_seed_plus_index() -> None:
    choices = fan_out([([1], SamplingParams(n=2, seed=7)), ([2, 3], SamplingParams(n=3))])
    assert [(c.prompt_index, c.index, c.prompt_ids) for c in choices] == [
        (0, 0, [1]), (0, 1, [1]), (1, 0, [2, 3]), (1, 1, [2, 3]), (1, 2, [2, 3])
    ]
    assert [c.params.seed for c in choices] == [7, 8, None, None, None]
    assert {c.params.n for c in choices} == {1}


def test_a_stop_string_ends_its_choice_only_and_later_deltas_are_skipped(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer, fan_out([([1], SamplingParams(n=2, stop="STOP", max_tokens=64))]), [EOS])
    held = processor.process(0, delta("ab ST"))
    assert (held.text, held.finish_reason, held.ended_by_stop_string) == ("ab ", None, False)  # "ST" may start STOP
    stopped = processor.process(0, delta("OP and more"))
    assert (stopped.text, stopped.finish_reason, stopped.ended_by_stop_string) == ("", FinishReason.STOP, True)
    assert processor.finished(0) and processor.unfinished() == [1]
    other = processor.process(1, delta("xy", FinishReason.LENGTH))
    assert (other.text, other.finish_reason, other.ended_by_stop_string) == ("xy", FinishReason.LENGTH, False)
    assert processor.num_unfinished == 0


def test_stop_strings_count_from_min_tokens_and_a_stop_token_leaves_no_text(tokenizer: Tokenizer) -> None:
    params = SamplingParams(stop=["x"], min_tokens=3, max_tokens=10)
    processor = OutputProcessor(tokenizer, fan_out([([1], params)]), [EOS])
    result = ChoiceResult(0)
    for update in (processor.process(0, delta("xx")), processor.process(0, delta([ord("a"), EOS], FinishReason.STOP))):
        result.add(update)
    assert (result.text, result.token_ids[-1], result.finish_reason) == ("xxa", EOS, FinishReason.STOP)


@pytest.mark.parametrize("field", sorted(FIELD_LIMITS))
def test_the_gateway_schema_and_sampling_params_accept_the_same_range(field: str) -> None:
    limit = FIELD_LIMITS[field]
    bounds = [bound for bound in (limit.ge, limit.gt, limit.le) if bound is not None]
    step = 1 if limit.kind is int else 1e-3
    candidates = [limit.kind(bound + offset) for bound in bounds for offset in (-step, 0, step)]
    schema_field = {"prompt_logprobs": "logprobs"}.get(field, field)  # completions' name for the same row
    for value in candidates:
        in_schema = _decodes(schema_field, value)
        in_params = _constructs(field, value)
        assert in_schema == in_params == limit.allows(value), (field, value, in_schema, in_params)


def _decodes(field: str, value: object) -> bool:
    body = {"model": "m", "prompt": "x", field: value}
    try:
        msgspec.json.decode(msgspec.json.encode(body), type=CompletionRequest)
    except msgspec.ValidationError:
        return False
    return True


def _constructs(field: str, value: object) -> bool:
    extra = {"max_tokens": value} if field == "min_tokens" and isinstance(value, int) and value >= 0 else {}
    try:
        SamplingParams(**{field: value, **extra})
    except SamplingParamError as exc:
        assert exc.field == field
        return False
    return True
