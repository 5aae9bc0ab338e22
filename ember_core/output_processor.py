"""One output processor for LLM.generate and the gateway. A call's choices (n per prompt, one
engine request each) get the engine's deltas; each becomes a text update by the same rules:
incremental detokenization, stop strings (only from min_tokens tokens on, text held back while it
may still start one), and the finish reason (a stop string ends a choice with `stop`, and its
engine request, still running, is the caller's to abort)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ember_core.sampling_params import SamplingParams
from ember_core.tokenizer import OutputText, StopRules, Tokenizer
from ember_proto import FinishReason, RequestDelta, TokenLogprob


@dataclass(frozen=True)
class ChoiceRequest:
    """One engine request: completion `index` of prompt `prompt_index`."""

    prompt_index: int
    index: int
    prompt_ids: list[int]
    params: SamplingParams  # n=1, the choice's own seed


def fan_out(prompts: list[tuple[list[int], SamplingParams]]) -> list[ChoiceRequest]:
    """The choices of prompts in OpenAI's order: prompt by prompt, n choices each."""
    return [
        ChoiceRequest(prompt_index, index, prompt_ids, params.for_choice(index))
        for prompt_index, (prompt_ids, params) in enumerate(prompts)
        for index in range(params.n)
    ]


@dataclass(frozen=True)
class ChoiceUpdate:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None  # on a choice's last update
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1, 2, ... (first update)
    ended_by_stop_string: bool = False  # the engine request still runs: abort it


@dataclass
class ChoiceResult:
    """A choice's updates put together: a whole response's choice."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, update: ChoiceUpdate) -> None:
        self.text_parts.append(update.text)
        self.token_ids.extend(update.token_ids)
        self.logprobs.extend(update.logprobs)
        self.prompt_logprobs.extend(update.prompt_logprobs)
        self.finish_reason = update.finish_reason


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, choices: list[ChoiceRequest], stop_token_ids: Iterable[int]) -> None:
        """Updates are numbered by position in choices. stop_token_ids: the model's (EOS, end of turn)."""
        self._texts = [
            OutputText(tokenizer, _stop_rules(choice.params), choice.params.skip_special_tokens) for choice in choices
        ]
        self._stop_token_ids = [frozenset(stop_token_ids).union(choice.params.stop_token_ids) for choice in choices]
        self._finished = [False] * len(choices)

    @property
    def num_unfinished(self) -> int:
        return self._finished.count(False)

    def unfinished(self) -> list[int]:
        return [index for index, finished in enumerate(self._finished) if not finished]

    def finished(self, index: int) -> bool:
        return self._finished[index]

    def process(self, index: int, delta: RequestDelta) -> ChoiceUpdate:
        """The update of an unfinished choice. Deltas of a choice a stop string ended may still
        come (sent before its abort reached the engine): callers skip them with finished()."""
        # a stop token's text is left out; a constraint that completed ends on a token of the output
        ended_by_token = delta.finish_reason is FinishReason.STOP and delta.new_token_ids
        stop_token = bool(ended_by_token) and delta.new_token_ids[-1] in self._stop_token_ids[index]
        match = self._texts[index].push(delta.new_token_ids, delta.finish_reason is not None, stop_token)
        finish_reason = FinishReason.STOP if match.stopped else delta.finish_reason
        self._finished[index] = finish_reason is not None
        return ChoiceUpdate(
            index=index,
            text=match.text,
            token_ids=delta.new_token_ids,
            logprobs=delta.logprobs,
            finish_reason=finish_reason,
            prompt_logprobs=delta.prompt_logprobs,
            ended_by_stop_string=match.stopped,
        )


def _stop_rules(params: SamplingParams) -> StopRules:
    return StopRules(params.stop, params.min_tokens, params.include_stop_str_in_output)
