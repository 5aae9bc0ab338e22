"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec

from ember_core.sampling_limits import FIELD_LIMITS, LOGIT_BIAS, MAX_STOP_STRINGS, TOKEN_ID
from ember_core.structured_outputs import StructuredOutputError, grammar_of
from ember_proto import SamplingOptions, StructuredOutputs

# Below this, sampling is argmax up to float32 rounding, and logits / temperature overflow to inf
# near 1e-38 (garbage tokens): such requests decode greedily, as in vLLM.
GREEDY_BELOW_TEMPERATURE = 1e-5
_SEED_SPACE = 2**63
_OPTIONAL = ("seed", "logprobs", "prompt_logprobs")  # None: no seed, no logprobs


class SamplingParamError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check(valid: bool, field: str, requirement: str, value: object) -> None:
    if not valid:
        raise SamplingParamError(field, f"{field} {requirement}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions of the prompt: one engine request each (output_processor.fan_out)
    max_tokens: int = 16  # 0: compute the prompt only (for its prompt_logprobs), generate nothing
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # vLLM's: tokens less likely than min_p times the most likely one are left out (after temperature)
    min_p: float = 0.0
    seed: int | None = None
    # Text that ends the output (the output processor's, not the engine's). The output's text stops
    # before it, and before the text of the stop token that ended the output, unless
    # include_stop_str_in_output. Stop strings count only from min_tokens tokens on.
    stop: str | tuple[str, ...] | list[str] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's: leave control tokens' text (<|im_end|>, [TOOL_CALLS], ...) out of the output's text
    skip_special_tokens: bool = True
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    # logprob of every prompt token after the first, with this many most likely alternatives
    prompt_logprobs: int | None = None
    # OpenAI's: minus presence_penalty for every token generated so far, minus frequency_penalty times
    # its count; vLLM's repetition_penalty divides positive (multiplies negative) logits of every
    # token of the prompt and output; logit_bias adds to a token's logit. All before temperature.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: lower runs first under the engine's priority scheduling policy; only 0 under fcfs
    priority: int = 0

    def __post_init__(self) -> None:
        for name, limit in FIELD_LIMITS.items():
            value = getattr(self, name)
            _check((value is None and name in _OPTIONAL) or limit.allows(value), name, f"must be {limit.describe()}", value)
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
