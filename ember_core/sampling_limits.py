"""The ranges of the sampling parameters, and the `Setting` each SamplingParams field is declared
with: SamplingParams checks against these rows (the engine's intake builds one from the wire), and
the gateway's request bodies decode against the same types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

MAX_STOP_STRINGS = 16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Limit:
    """An int or float range. A bool is not an integer here; nan and inf fall outside every float
    row, each bounded on both sides."""

    kind: type[int] | type[float]
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    note: str = ""  # what a value means, where the range alone does not say

    @property
    def type(self) -> Any:
        """The range as an annotated type, for msgspec to check while decoding."""
        bounds = {name: value for name, value in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if value is not None}
        return Annotated[self.kind, Meta(**bounds)]

    def allows(self, value: object) -> bool:
        try:
            msgspec.convert(value, self.type)
        except msgspec.ValidationError:
            return False
        return True

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        high = None if self.le == INT64_MAX else self.le  # the wire's bound, not the parameter's
        if self.ge == INT64_MIN and high is None:
            text = "a 64-bit integer"
        elif high is not None:
            low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}"
            text = f"{noun} in {low}, {high:g}]"
        else:
            text = f"{noun} >= {self.ge:g}" if self.ge is not None else f"{noun} > {self.gt:g}"
        return f"{text} {self.note}".rstrip()

N = Limit(int, ge=1, le=128)
TOKEN_COUNT = Limit(int, ge=0)  # max_tokens, min_tokens
TEMPERATURE = Limit(float, ge=0, le=2)
TOP_P = Limit(float, ge=0, le=1, note="(0 keeps only the most likely token, as OpenAI allows)")
TOP_K = Limit(int, ge=-1, le=INT64_MAX, note="(0 and -1 disable it)")
MIN_P = Limit(float, ge=0, le=1)
SEED = Limit(int, ge=INT64_MIN, le=INT64_MAX)
LOGPROBS = Limit(int, ge=0, le=20)
PENALTY = Limit(float, ge=-2, le=2)  # presence_penalty, frequency_penalty
REPETITION_PENALTY = Limit(float, gt=0, le=2)
LOGIT_BIAS = Limit(float, ge=-100, le=100)
TOKEN_ID = Limit(int, ge=0)
PRIORITY = Limit(int, ge=INT64_MIN, le=INT64_MAX)  # lower runs first (the priority scheduling policy)



@dataclass(frozen=True)
class Setting:
    """What a SamplingParams field declares beside its type and default (sampling_params.py): what it
    means (the CLI's help, the OpenAPI document's description), its range, how an HTTP body carries
    it, and whether the engine samples with it, so that it travels on the wire (SamplingOptions).

    body: "value" -- the body's field of that name, with the same default; "nullable" -- also
    null, which means the default (OpenAI's fields and vLLM's sampling ones); "mapped" -- the
    endpoints read it from their own fields (max_tokens, logprobs, logit_bias, ...)."""

    meaning: str
    limit: Limit | None = None
    body: Literal["value", "nullable", "mapped"] = "nullable"
    body_type: Any = None  # the body's type, where the limit does not give it
    engine: bool = True
