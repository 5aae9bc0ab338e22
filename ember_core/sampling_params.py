"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import dataclass

# Below this, sampling is argmax up to float32 rounding, and logits / temperature overflow to inf
# near 1e-38 (garbage tokens): such requests decode greedily, as in vLLM.
GREEDY_BELOW_TEMPERATURE = 1e-5
_SEED_SPACE = 2**63


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
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not isinstance(token, int) or not -100 <= bias <= 100 for token, bias in (self.logit_bias or {}).items()):
            raise ValueError(f"logit_bias must map token ids to biases in [-100, 100], got {self.logit_bias!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(text, str) or not text for text in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling depends on the tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
