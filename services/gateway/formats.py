"""The format step: choice updates and results shaped as each API's JSON, chat completions and
legacy completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ember_core.output_processor import ChoiceResult, ChoiceUpdate
from ember_core.tokenizer import Tokenizer
from ember_gateway.logprobs import TextOffsets, chat_logprobs, completion_logprobs, echoed_prompt_logprobs
from ember_gateway.tools import CallStream, ToolPlan, parse_calls
from ember_proto import FinishReason, TokenLogprob


class ResponseFormat(Protocol):
    object_name: str
    chunk_object_name: str

    def stream_start(self, index: int) -> dict[str, Any] | None:
        """The choice of a stream's first chunk for choice index, if the API sends one."""

    def stream_choices(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        """The chunk choices an update becomes (none when it carries nothing to show)."""

    def final_choice(self, result: ChoiceResult) -> dict[str, Any]: ...


class ChatFormat:
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self, tokenizer: Tokenizer | None, logprobs: bool, return_token_ids: bool, tools: ToolPlan | None = None
    ) -> None:
        """tools: a choice's output may be tool calls; a stream sends each call once it is complete
        (CallStream), and the logprobs and token ids of held text with the chunk that sends it."""
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._return_token_ids = return_token_ids
        self._tools = tools
        self._calls: dict[int, CallStream] = {}
        self._unsent: dict[int, ChoiceResult] = {}

    def stream_start(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def stream_choices(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        if self._tools is not None:
            return self._tool_stream_choices(update)
        choices = []
        if _has_content(update, self._logprobs, self._return_token_ids):
            delta = {"content": update.text}
            choices.append(self._choice(update.index, "delta", delta, update.logprobs, update.token_ids, None))
        if update.finish_reason is not None:
            finish = {"index": update.index, "delta": {}, "logprobs": None, "finish_reason": update.finish_reason.label}
            choices.append(finish)
        return choices

    def final_choice(self, result: ChoiceResult) -> dict[str, Any]:
        # OpenAI requires refusal in a message (null: ember's models answer in content); deltas omit it
        message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
        calls = []
        if self._tools is not None:
            message["content"], calls = parse_calls(self._tools, result.text)
            if calls:
                message["tool_calls"] = calls
        choice = self._choice(result.index, "message", message, result.logprobs, result.token_ids, result.finish_reason)
        if calls:
            choice["finish_reason"] = "tool_calls"
        return choice

    def _tool_stream_choices(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        assert self._tools is not None
        calls = self._calls.setdefault(update.index, CallStream(self._tools))
        unsent = self._unsent.setdefault(update.index, ChoiceResult(update.index))
        unsent.add(update)
        content, entries = calls.feed(update.text)
        if update.finish_reason is not None:
            more_content, more_entries = calls.finish()
            content, entries = content + more_content, entries + more_entries
        delta: dict[str, Any] = {"content": content} if content else {}
        if entries:
            delta["tool_calls"] = entries
        chunks = []
        if delta or (update.finish_reason is not None and _has_content(unsent, self._logprobs, self._return_token_ids)):
            chunks.append(self._choice(update.index, "delta", delta, unsent.logprobs, unsent.token_ids, None))
            del self._unsent[update.index]
        if update.finish_reason is not None:
            finish = "tool_calls" if calls.num_calls else update.finish_reason.label
            chunks.append({"index": update.index, "delta": {}, "logprobs": None, "finish_reason": finish})
            del self._calls[update.index]
            self._unsent.pop(update.index, None)
        return chunks

    def _choice(
        self,
        index: int,
        key: str,
        value: dict[str, Any],
        logprobs: list[TokenLogprob],
        token_ids: list[int],
        finish_reason: FinishReason | None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            key: value,
            "logprobs": chat_logprobs(self._tokenizer, logprobs) if self._logprobs else None,
            "finish_reason": _label(finish_reason),
        }
        if self._return_token_ids:
            choice["token_ids"] = token_ids
        return choice


@dataclass(frozen=True)
class Echo:
    text: str
    prompt_ids: list[int]


class CompletionFormat:
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self, tokenizer: Tokenizer | None, echoes: list[Echo | None], logprobs: bool, return_token_ids: bool
    ) -> None:
        """echoes: per choice, the prompt to echo before its text, or None."""
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._return_token_ids = return_token_ids
        self._echoes = echoes
        self._unsent_echoes = list(echoes)  # a stream sends a choice's echo with its first chunk
        self._offsets = [TextOffsets(tokenizer, len(echo.text) if echo else 0) for echo in echoes]

    def stream_start(self, index: int) -> dict[str, Any] | None:
        return None

    def stream_choices(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        index = update.index
        echo = self._unsent_echoes[index]
        if echo is None and not (update.finish_reason or _has_content(update, self._logprobs, self._return_token_ids)):
            return []
        self._unsent_echoes[index] = None
        return [
            self._choice(
                index, update.text, update.logprobs, update.token_ids, update.finish_reason, echo, update.prompt_logprobs
            )
        ]

    def final_choice(self, result: ChoiceResult) -> dict[str, Any]:
        return self._choice(
            result.index,
            result.text,
            result.logprobs,
            result.token_ids,
            result.finish_reason,
            self._echoes[result.index],
            result.prompt_logprobs,
        )

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob],
        token_ids: list[int],
        finish_reason: FinishReason | None,
        echo: Echo | None,
        prompt_logprobs: list[TokenLogprob],
    ) -> dict[str, Any]:
        """echo: the prompt to put before text (a stream's first chunk, a whole response)."""
        choice: dict[str, Any] = {
            "index": index,
            "text": (echo.text if echo else "") + text,
            "logprobs": None,
            "finish_reason": _label(finish_reason),
        }
        if self._logprobs:
            entries = completion_logprobs(self._tokenizer, logprobs, self._offsets[index])
            if echo is not None:
                entries = echoed_prompt_logprobs(self._tokenizer, echo.prompt_ids, prompt_logprobs) + entries
            choice["logprobs"] = entries
        if self._return_token_ids:
            choice["token_ids"] = token_ids
        return choice


def _label(finish_reason: FinishReason | None) -> str | None:
    return None if finish_reason is None else finish_reason.label


def _has_content(update: ChoiceUpdate | ChoiceResult, logprobs: bool, token_ids: bool) -> bool:
    """Whether a stream chunk of this update would carry anything: text, or logprobs or token ids
    when the client asked for them."""
    return bool(update.text or (logprobs and update.logprobs) or (token_ids and update.token_ids))
