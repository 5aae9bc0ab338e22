"""`--speculative-config`: vLLM's JSON spelling of n-gram (prompt lookup) speculative decoding."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # Draft tokens a sequence proposes per step; the step verifies them and the token after them.
    num_speculative_tokens: int = 4
    # The longest and shortest suffix of the sequence looked up earlier in its prompt and output.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # No drafts in a step that runs more sequences than this: a batch that size already uses the
    # weights each step reads, so extra rows cost about what they save.
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config: method must be 'ngram' (the only one ember runs), got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )


def speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """The config from its JSON text (the flag), a dict (LLM's keyword) or itself; None or an empty text: off."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")  # noqa: TRY004
    known = {spec.name for spec in fields(SpeculativeConfig)}
    if unknown := sorted(set(value) - known):
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if "method" not in value:
        raise ValueError('speculative_config needs "method": "ngram"')
    return SpeculativeConfig(**value)
