"""The format step: choice updates and results shaped as each API's JSON, chat completions and
legacy completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec
from msgspec import UNSET

from ember_core.output_processor import ChoiceResult, ChoiceUpdate
from ember_core.tokenizer import Tokenizer
from ember_gateway.api.completions.logprobs import (
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
)
from ember_gateway.api.completions.tools import CallStream, ToolPlan, parse_calls
from ember_gateway.api.response_bodies import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionDelta,
    ChatCompletionMessage,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    ToolCall,
    ToolCallChunk,
)
from ember_proto import FinishReason, TokenLogprob

Choice = ChatCompletionChoice | CompletionChoice
ChunkChoice = ChatCompletionChunkChoice | CompletionChunkChoice
_CompletionChoiceShape = TypeVar("_CompletionChoiceShape", CompletionChoice, CompletionChunkChoice)


class ApiShape(Protocol):
    """The chat or the completions shape of a response (ChatFormat, CompletionFormat): its body and
    chunk types and the choices in them. Not OpenAI's `response_format` request field (constraints.py)."""

    object_name: str
    chunk_object_name: str
    body_type: type[ChatCompletion | Completion]
    chunk_type: type[ChatCompletionChunk | CompletionChunk]

    def stream_start(self, index: int) -> ChunkChoice | None:
        """The choice of a stream's first chunk for choice index, if the API sends one."""

    def stream_choices(self, update: ChoiceUpdate) -> list[ChunkChoice]:
        """The chunk choices an update becomes (none when it carries nothing to show)."""

    def final_choice(self, result: ChoiceResult) -> Choice: ...


class ChatFormat:
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    body_type = ChatCompletion
    chunk_type = ChatCompletionChunk

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

    def stream_start(self, index: int) -> ChatCompletionChunkChoice:
        delta = ChatCompletionDelta(role="assistant", content="")
        return ChatCompletionChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=None)

    def stream_choices(self, update: ChoiceUpdate) -> list[ChatCompletionChunkChoice]:
        if self._tools is not None:
            return self._tool_stream_choices(update)
        choices = []
        if _has_content(update, self._logprobs, self._return_token_ids):
            choices.append(self._delta_choice(ChatCompletionDelta(content=update.text), update))
        if update.finish_reason is not None:
            choices.append(_finish_chunk(update.index, update.finish_reason.label))
        return choices

    def final_choice(self, result: ChoiceResult) -> ChatCompletionChoice:
        content, calls = result.text, []
        if self._tools is not None:
            content, calls = parse_calls(self._tools, result.text)
        # OpenAI requires refusal in a message (null: ember's models answer in content); deltas omit it
        message = ChatCompletionMessage(
            role="assistant", content=content, refusal=None,
            tool_calls=msgspec.convert(calls, list[ToolCall]) if calls else UNSET,
        )
        return ChatCompletionChoice(
            index=result.index,
            message=message,
            logprobs=self._chat_logprobs(result.logprobs),
            finish_reason="tool_calls" if calls else _label(result.finish_reason),
            token_ids=result.token_ids if self._return_token_ids else UNSET,
        )

    def _tool_stream_choices(self, update: ChoiceUpdate) -> list[ChatCompletionChunkChoice]:
        assert self._tools is not None
        calls = self._calls.setdefault(update.index, CallStream(self._tools))
        unsent = self._unsent.setdefault(update.index, ChoiceResult(update.index))
        unsent.add(update)
        content, entries = calls.feed(update.text)
        if update.finish_reason is not None:
            more_content, more_entries = calls.finish()
            content, entries = content + more_content, entries + more_entries
        chunks = []
        if content or entries or (
            update.finish_reason is not None and _has_content(unsent, self._logprobs, self._return_token_ids)
        ):
            delta = ChatCompletionDelta(
                content=content or UNSET, tool_calls=msgspec.convert(entries, list[ToolCallChunk]) if entries else UNSET
            )
            chunks.append(self._delta_choice(delta, unsent))
            del self._unsent[update.index]
        if update.finish_reason is not None:
            chunks.append(_finish_chunk(update.index, "tool_calls" if calls.num_calls else update.finish_reason.label))
            del self._calls[update.index]
            self._unsent.pop(update.index, None)
        return chunks

    def _delta_choice(
        self, delta: ChatCompletionDelta, source: ChoiceUpdate | ChoiceResult
    ) -> ChatCompletionChunkChoice:
        """A chunk choice sending delta, with source's logprobs and token ids when they are asked for."""
        return ChatCompletionChunkChoice(
            index=source.index,
            delta=delta,
            logprobs=self._chat_logprobs(source.logprobs),
            finish_reason=None,
            token_ids=source.token_ids if self._return_token_ids else UNSET,
        )

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(self._tokenizer, entries) if self._logprobs else None


@dataclass(frozen=True)
class Echo:
    text: str
    prompt_ids: list[int]


class CompletionFormat:
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    body_type = Completion
    chunk_type = CompletionChunk

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

    def stream_start(self, index: int) -> CompletionChunkChoice | None:
        return None

    def stream_choices(self, update: ChoiceUpdate) -> list[CompletionChunkChoice]:
        index = update.index
        echo = self._unsent_echoes[index]
        if echo is None and not (update.finish_reason or _has_content(update, self._logprobs, self._return_token_ids)):
            return []
        self._unsent_echoes[index] = None
        return [self._choice(CompletionChunkChoice, update, echo)]

    def final_choice(self, result: ChoiceResult) -> CompletionChoice:
        return self._choice(CompletionChoice, result, self._echoes[result.index])

    def _choice(
        self, shape: type[_CompletionChoiceShape], source: ChoiceUpdate | ChoiceResult, echo: Echo | None
    ) -> _CompletionChoiceShape:
        """echo: the prompt to put before source's text (a stream's first chunk, a whole response)."""
        logprobs = None
        if self._logprobs:
            logprobs = completion_logprobs(self._tokenizer, source.logprobs, self._offsets[source.index])
            if echo is not None:
                logprobs = echoed_prompt_logprobs(self._tokenizer, echo.prompt_ids, source.prompt_logprobs) + logprobs
        return shape(
            index=source.index,
            text=(echo.text if echo else "") + source.text,
            logprobs=logprobs,
            finish_reason=_label(source.finish_reason),
            token_ids=source.token_ids if self._return_token_ids else UNSET,
        )


def _label(finish_reason: FinishReason | None) -> str | None:
    return None if finish_reason is None else finish_reason.label


def _finish_chunk(index: int, label: str) -> ChatCompletionChunkChoice:
    return ChatCompletionChunkChoice(index=index, delta=ChatCompletionDelta(), logprobs=None, finish_reason=label)


def _has_content(update: ChoiceUpdate | ChoiceResult, logprobs: bool, token_ids: bool) -> bool:
    """Whether a stream chunk of this update would carry anything: text, or logprobs or token ids
    when the client asked for them."""
    return bool(update.text or (logprobs and update.logprobs) or (token_ids and update.token_ids))
