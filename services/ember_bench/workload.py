"""Benchmark requests: loaded from a workload file or made up from random words / token ids."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

# Common English words that BPE vocabularies hold as single tokens, so a random prompt of
# N words is close to N tokens under most tokenizers.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but "
    "one all were when we there can an which their said if do will each about how up out them "
    "then she many some so these would other into has more two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much go good new "
    "write our me man too any day same right look think also around another came come work "
    "three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along while"
).split()


class WorkloadError(ValueError):
    """A workload file or random-prompt setting that cannot be used."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


def load_workload(path: str | Path) -> list[BenchRequest]:
    """A JSON list of {"prompt", "max_tokens"} objects; other keys are ignored."""
    try:
        items = json.loads(Path(path).read_text())
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"workload {path} is not valid JSON: {exc}") from None
    if not isinstance(items, list) or not items:
        raise WorkloadError(f"workload {path} must be a non-empty JSON list of {{prompt, max_tokens}} objects")
    return [_request(item, index, path) for index, item in enumerate(items)]


def _request(item: object, index: int, path: str | Path) -> BenchRequest:
    where = f"workload {path}, item {index}"
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: expected an object, got {type(item).__name__}")
    prompt = item.get("prompt")
    is_token_ids = isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_token_ids:
        raise WorkloadError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
    max_tokens = item.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise WorkloadError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    return BenchRequest(prompt, max_tokens)


@dataclass(frozen=True)
class RandomPrompts:
    """`count` prompts of `input_len` random words (or token ids) each asking for `output_len` tokens."""

    count: int
    input_len: int
    output_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        for flag, value in (("--random-prompts", self.count), ("--random-input-len", self.input_len),
                            ("--random-output-len", self.output_len)):
            if value < 1:
                raise WorkloadError(f"{flag} must be >= 1, got {value}")

    def words(self) -> list[BenchRequest]:
        rng = random.Random(self.seed)
        return [
            BenchRequest(" ".join(rng.choices(WORDS, k=self.input_len)), self.output_len) for _ in range(self.count)
        ]

    def token_ids(self, vocab_size: int) -> list[BenchRequest]:
        """For models without a tokenizer; id 0 is left out as it is often BOS/EOS."""
        rng = random.Random(self.seed)
        return [
            BenchRequest([rng.randrange(1, vocab_size) for _ in range(self.input_len)], self.output_len)
            for _ in range(self.count)
        ]


def take(requests: list[BenchRequest], num_prompts: int | None) -> list[BenchRequest]:
    """The first num_prompts requests, cycling through the list when it is shorter."""
    if num_prompts is None:
        return requests
    if num_prompts < 1:
        raise WorkloadError(f"--num-prompts must be >= 1, got {num_prompts}")
    return list(itertools.islice(itertools.cycle(requests), num_prompts))
