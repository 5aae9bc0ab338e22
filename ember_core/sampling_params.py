"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Below this, sampling is argmax up to float32 rounding, and logits / temperature overflow to inf
# near 1e-38 (garbage tokens): such requests decode greedily, as in vLLM.
GREEDY_BELOW_TEMPERATURE = 1e-5
_SEED_SPACE = 2**63


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(valid: bool, message: str, value: object) -> None:
    if not valid:
        raise ValueError(f"{message}, got {value!r}")


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of completion `choice` of a request's n: seed + choice, so the completions differ
    and the first one is the request's with n=1."""
    return None if seed is None else (seed + choice) % _SEED_SPACE


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions of the prompt (LLM.generate; the gateway sends one engine request per choice)
    max_tokens: int = 16  # 0: compute the prompt only (for its prompt_logprobs), generate nothing
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # vLLM's: tokens less likely than min_p times the most likely one are left out (after temperature)
    min_p: float = 0.0
    seed: int | None = None
    # Text that ends the output (LLM.generate; the gateway applies a request's `stop` itself). The
    # output's text stops before it, and before the text of the stop token that ended the output,
    # unless include_stop_str_in_output. Stop strings count only from min_tokens tokens on.
    stop: str | tuple[str, ...] | list[str] | None = None
    include_stop_str_in_output: bool = False
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

    def __post_init__(self) -> None:
        # The server's checks (services/gateway/schemas.py), for in-process callers: bools are not
        # integers here, nan and inf are not numbers.
        _check(_is_int(self.n) and self.n >= 1, "n must be an integer >= 1", self.n)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens must be an integer >= 0", self.max_tokens)
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature must be a number >= 0", self.temperature)
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0 (0 disables it)", self.top_k)
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]", self.min_p)
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens must be an integer in [0, max_tokens]", self.min_tokens,
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0), f"{name} must be an integer >= 0", value)
        _check(self.seed is None or (_is_int(self.seed) and -_SEED_SPACE <= self.seed < _SEED_SPACE),
               "seed must be a 64-bit integer", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, f"{name} must be in [-2, 2]", value)
        _check(_is_real(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
               "repetition_penalty must be in (0, 2]", self.repetition_penalty)
        _check(
            isinstance(self.logit_bias, (dict, type(None)))
            and all(_is_int(token) and _is_real(bias) and -100 <= bias <= 100 for token, bias in (self.logit_bias or {}).items()),
            "logit_bias must map token ids to biases in [-100, 100]", self.logit_bias,
        )
        stop_token_ids = tuple(self.stop_token_ids or ())
        _check(all(_is_int(token) and token >= 0 for token in stop_token_ids), "stop_token_ids must be token ids", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        _check(all(isinstance(text, str) and text for text in stop), "stop must be non-empty strings", self.stop)
        object.__setattr__(self, "stop", stop)

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling depends on the tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
