"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from typing import Annotated, Any, get_type_hints

import msgspec
from msgspec import Meta

from ember_core.sampling_limits import (
    LOGIT_BIAS,
    LOGPROBS,
    MAX_STOP_STRINGS,
    MIN_P,
    PENALTY,
    PRIORITY,
    REPETITION_PENALTY,
    SEED,
    TEMPERATURE,
    TOKEN_COUNT,
    TOKEN_ID,
    TOP_K,
    TOP_P,
    Limit,
    N,
    Setting,
)
from ember_core.structured_outputs import StructuredOutputError, grammar_of
from ember_proto import SamplingOptions, StructuredOutputs

# Below this, sampling is argmax up to float32 rounding, and logits / temperature overflow to inf
# near 1e-38 (garbage tokens): such requests decode greedily, as in vLLM.
GREEDY_BELOW_TEMPERATURE = 1e-5
_SEED_SPACE = 2**63


class SamplingParamError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check(valid: bool, field: str, requirement: str, value: object) -> None:
    if not valid:
        raise SamplingParamError(field, f"{field} {requirement}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling and stopping settings. Each field is declared here once: its type,
    default and Setting (range, meaning, how an HTTP body carries it, whether the engine needs it).
    The gateway's request bodies, the OpenAPI document and `ember generate`'s flags are made from
    these declarations; the wire's SamplingOptions keeps its own (versioned) copy of the engine's
    fields, which tests/core/package/test_sampling_settings.py holds to these."""

    n: Annotated[int, Setting("completions of the prompt, one engine request each", N, engine=False)] = 1
    max_tokens: Annotated[int, Setting(
        "tokens to generate at most; 0: compute the prompt only (for its prompt_logprobs)", TOKEN_COUNT,
    )] = 16
    temperature: Annotated[float, Setting("divides the logits before sampling; 0: greedy", TEMPERATURE)] = 1.0
    top_p: Annotated[float, Setting("sample from the most likely tokens whose probabilities sum to top_p", TOP_P)] = 1.0
    top_k: Annotated[int, Setting("sample from the top_k most likely tokens", TOP_K)] = 0
    min_p: Annotated[float, Setting(
        "vLLM's: tokens less likely than min_p times the most likely one are left out (after temperature)", MIN_P,
    )] = 0.0
    seed: Annotated[int | None, Setting("seeds this request's sampling, whatever else the batch holds", SEED)] = None
    # The output processor's, not the engine's: the output's text stops before it, and before the
    # text of the stop token that ended the output, unless include_stop_str_in_output.
    stop: Annotated[str | tuple[str, ...] | list[str] | None, Setting(
        "text that ends the output, counted from min_tokens tokens on",
        body_type=str | Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)], engine=False,
    )] = None
    include_stop_str_in_output: Annotated[bool, Setting(
        "vLLM's: keep the stop string or stop token's text in the output", body="value", engine=False,
    )] = False
    skip_special_tokens: Annotated[bool, Setting(
        "vLLM's: leave control tokens' text (<|im_end|>, [TOOL_CALLS], ...) out of the output's text",
        body="value", engine=False,
    )] = True
    stop_token_ids: Annotated[tuple[int, ...] | list[int] | None, Setting(
        "token ids that end the output, beside the model's end of sequence", body_type=list[TOKEN_ID.type],
    )] = None
    ignore_eos: Annotated[bool, Setting("go on past the end-of-sequence token", body="value")] = False
    min_tokens: Annotated[int, Setting(
        "tokens generated before a stop token or string may end the output", TOKEN_COUNT, body="value",
    )] = 0
    logprobs: Annotated[int | None, Setting(
        "the sampled token's logprob, with this many most likely alternatives", LOGPROBS, body="mapped",
    )] = None
    prompt_logprobs: Annotated[int | None, Setting(
        "the logprob of every prompt token after the first, with this many alternatives", LOGPROBS, body="mapped",
    )] = None
    # All before temperature: OpenAI's presence and frequency penalties, vLLM's repetition penalty
    # (divides positive, multiplies negative logits of every token of the prompt and output) and the
    # logit bias.
    presence_penalty: Annotated[float, Setting(
        "subtracted from the logit of every token generated so far", PENALTY,
    )] = 0.0
    frequency_penalty: Annotated[float, Setting(
        "times a token's count so far, subtracted from its logit", PENALTY,
    )] = 0.0
    repetition_penalty: Annotated[float, Setting(
        "vLLM's: divides the positive logits (multiplies the negative) of the prompt's and output's tokens",
        REPETITION_PENALTY,
    )] = 1.0
    logit_bias: Annotated[dict[int, float] | None, Setting(
        "token id -> a bias added to its logit", body="mapped",
    )] = None
    structured_outputs: Annotated[StructuredOutputs | None, Setting(
        "constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar", body="mapped",
    )] = None
    priority: Annotated[int, Setting(
        "vLLM's: lower runs first under the engine's priority scheduling policy; only 0 under fcfs", PRIORITY,
        body="value",
    )] = 0

    def __post_init__(self) -> None:
        for name, limit in FIELD_LIMITS.items():
            value = getattr(self, name)
            optional = SETTINGS[name].default is None  # None: no seed, no logprobs
            _check((value is None and optional) or limit.allows(value), name, f"must be {limit.describe()}", value)
        _check(self.min_tokens <= self.max_tokens, "min_tokens", f"must be at most max_tokens ({self.max_tokens})", self.min_tokens)
        if self.top_k == -1:  # vLLM's "off", as 0
            object.__setattr__(self, "top_k", 0)
        _check(
            isinstance(self.logit_bias, (dict, type(None)))
            and all(TOKEN_ID.allows(token) and LOGIT_BIAS.allows(bias) for token, bias in (self.logit_bias or {}).items()),
            "logit_bias", f"must map token ids to {LOGIT_BIAS.describe()}", self.logit_bias,
        )
        stop_token_ids = tuple(self.stop_token_ids or ())
        _check(all(TOKEN_ID.allows(token) for token in stop_token_ids), "stop_token_ids", "must be token ids", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        _check(all(isinstance(text, str) and text for text in stop), "stop", "must be non-empty strings", self.stop)
        _check(len(stop) <= MAX_STOP_STRINGS, "stop", f"must be at most {MAX_STOP_STRINGS} strings", self.stop)
        object.__setattr__(self, "stop", stop)
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputs), "structured_outputs",
                   "must be an ember_proto.StructuredOutputs", self.structured_outputs)
            try:
                grammar_of(self.structured_outputs)
            except StructuredOutputError as exc:
                raise SamplingParamError("structured_outputs", f"structured_outputs: {exc}") from None

    @classmethod
    def from_wire(cls, options: SamplingOptions) -> SamplingParams:
        return cls(**msgspec.structs.asdict(options))

    def to_wire(self) -> SamplingOptions:
        """What the engine needs of these params (n and stop strings are the output processor's)."""
        return SamplingOptions(**{name: getattr(self, name) for name in SamplingOptions.__struct_fields__})

    def for_choice(self, index: int) -> SamplingParams:
        """Completion `index` of the n, as one engine request: seed + index, so the completions
        differ and the first one is the request's with n=1."""
        seed = None if self.seed is None else (self.seed + index) % _SEED_SPACE
        return replace(self, n=1, seed=seed)

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling depends on the tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1 or self.top_p == 0


@dataclass(frozen=True)
class DeclaredSetting:
    """A SamplingParams field as declared: its name, Python type, default and Setting."""

    name: str
    type: Any
    default: Any
    setting: Setting


def _declared_settings() -> dict[str, DeclaredSetting]:
    hints = get_type_hints(SamplingParams, include_extras=True)
    declared = {}
    for field in fields(SamplingParams):
        python_type, setting = hints[field.name].__origin__, hints[field.name].__metadata__[0]
        if field.default is MISSING or not isinstance(setting, Setting):
            raise TypeError(f"SamplingParams.{field.name} needs a default and a Setting")
        declared[field.name] = DeclaredSetting(field.name, python_type, field.default, setting)
    return declared


SETTINGS = _declared_settings()
FIELD_LIMITS: dict[str, Limit] = {name: s.setting.limit for name, s in SETTINGS.items() if s.setting.limit is not None}
