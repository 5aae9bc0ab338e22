"""Validated request fields and tokenized prompts turned into the request's choices (one engine
request each), fanned out as LLM.generate fans them out."""

from __future__ import annotations

import msgspec

from ember_core.output_processor import ChoiceRequest, fan_out
from ember_core.sampling_params import SETTINGS, SamplingParamError, SamplingParams
from ember_gateway.api.completions.constraints import structured_outputs_of
from ember_gateway.api.request_bodies import GenerationRequest
from ember_gateway.edge.errors import ApiError
from ember_gateway.engines.served_model import ServedModel
from ember_proto import StructuredOutputs


def build_choices(
    body: GenerationRequest,
    model: ServedModel,
    prompts: list[list[int]],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    prompt_logprobs: int | None = None,
    tool_constraint: StructuredOutputs | None = None,
    keep_special_tokens: bool = False,
) -> list[ChoiceRequest]:
    """max_tokens None: as many as the context leaves. tool_constraint: the calls a tool_choice allows.
    keep_special_tokens: whatever the request says, for a tool parser that reads a control token."""
    vocab_size = model.card.vocab_size
    _check_token_ids(body.stop_token_ids or [], vocab_size, "stop_token_ids")
    logit_bias = _logit_bias(body.logit_bias, vocab_size)
    if body.stop and model.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer and this model has none; use stop_token_ids", param="stop")
    for prompt in prompts:
        check_prompt(prompt, model, prompt_param)
    budgets = [_completion_budget(len(prompt), max_tokens, model.card.max_model_len, prompt_param) for prompt in prompts]
    structured_outputs = structured_outputs_of(body)
    if tool_constraint is not None:
        if structured_outputs is not None:
            raise ApiError(400, "a tool_choice that forces a call leaves no room for another output constraint",
                           param="tool_choice")
        structured_outputs = tool_constraint
    if structured_outputs is not None and model.tokenizer is None:
        raise ApiError(400, "structured outputs need a tokenizer and this model has none")
    if structured_outputs is not None and body.json_any_whitespace:  # else JSON comes out compact
        structured_outputs = msgspec.structs.replace(structured_outputs, any_whitespace=True)
    try:
        return fan_out([
            (prompt, _sampling_params(body, budget, logprobs, prompt_logprobs, logit_bias, structured_outputs,
                                      body.skip_special_tokens and not keep_special_tokens))
            for prompt, budget in zip(prompts, budgets)
        ])
    except SamplingParamError as exc:  # a rule across fields: the schema checked each alone
        raise ApiError(400, str(exc), param=exc.field) from None


def check_prompt(prompt: list[int], model: ServedModel, param: str) -> None:
    """Not empty, and every id a token of the model's vocabulary and tokenizer."""
    if not prompt:
        raise ApiError(400, "the prompt must not be empty", param=param)
    _check_token_ids(prompt, model.card.vocab_size, param)
    _check_tokenizer_has(prompt, model, param)


# The settings a body carries under their own names (request_bodies.GenerationRequest)
BODY_SETTINGS = [name for name, declared in SETTINGS.items() if declared.setting.body != "mapped"]


def _sampling_params(
    body: GenerationRequest,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    logit_bias: dict[int, float] | None,
    structured_outputs: StructuredOutputs | None,
    skip_special_tokens: bool,
) -> SamplingParams:
    """The request's settings, SamplingParams' defaults where it left them out (null), and the
    settings each endpoint maps itself."""
    given = {name: value for name in BODY_SETTINGS if (value := getattr(body, name)) is not None}
    return SamplingParams(**{
        **given,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "logit_bias": logit_bias,
        "structured_outputs": structured_outputs,
        "skip_special_tokens": skip_special_tokens,
    })


def _logit_bias(biases: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not biases:
        return None
    try:
        by_id = {int(token): bias for token, bias in biases.items()}
    except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    _check_token_ids(list(by_id), vocab_size, "logit_bias")
    return by_id


def _check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((token_id for token_id in token_ids if not 0 <= token_id < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def _check_tokenizer_has(token_ids: list[int], model: ServedModel, param: str) -> None:
    """Prompt ids must be tokens (as in vLLM): a model's vocabulary is often padded past its tokenizer's."""
    if model.tokenizer is None:
        return
    try:
        model.tokenizer.decode_bytes(token_ids)
    except ValueError as exc:
        raise ApiError(400, f"prompt token ids must be tokens of this model's tokenizer: {exc}", param=param) from None


def _completion_budget(prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str) -> int:
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                f"{prompt_tokens} tokens, which leaves no room for a completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param=prompt_param if prompt_tokens >= max_model_len else "max_tokens",  # the prompt alone does not fit
            code="context_length_exceeded",
        )
    return max_tokens
