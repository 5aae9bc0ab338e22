"""The typed events of a streamed Response, in OpenAI's order and numbered: `response.created` and
`response.in_progress`; per output item `response.output_item.added`, its content
(`response.content_part.added`, `response.output_text.delta`s, `.done`, `response.content_part.done`;
or a call's `response.function_call_arguments.delta` and `.done`), `response.output_item.done`; then
`response.completed`, `response.incomplete` (at max_output_tokens) or `response.failed`.

Text goes out as it comes. With tools, text that may begin a call is held back and each call comes
whole once complete (tools.CallStream, as chat streams them), closing the message before it; text
after a call opens a new message. Whitespace alone opens no message."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import msgspec

from ember_core.output_processor import ChoiceUpdate
from ember_gateway.api.completions.tools import CallStream, ToolPlan
from ember_gateway.api.responses.objects import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    ItemStatus,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputTextDelta,
    OutputTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseEvent,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseUsage,
)
from ember_gateway.api.responses.output import ResponseEcho, function_call_item, message_item, output_text
from ember_gateway.edge.errors import ApiError


class ResponseEvents:
    def __init__(self, echo: ResponseEcho, tools: ToolPlan | None) -> None:
        self._echo = echo
        self._calls = None if tools is None else CallStream(tools)
        self._sequence = itertools.count()
        self._output: list[OutputItem] = []  # the items done, then the open message as it is
        self._message: _OpenMessage | None = None
        self._held = ""  # whitespace that has not opened a message

    def start(self) -> list[ResponseEvent]:
        response = self._echo("in_progress")
        return [self._event(ResponseCreated, response=response), self._event(ResponseInProgress, response=response)]

    def update(self, update: ChoiceUpdate) -> list[ResponseEvent]:
        if self._calls is None:
            content, calls = update.text, []
        else:
            content, calls = self._calls.feed(update.text)
            if update.finish_reason is not None:
                more_content, more_calls = self._calls.finish()
                content, calls = content + more_content, calls + more_calls
        events = self._text(content)
        for call in calls:
            events += self._close_message("completed") + self._function_call(call)
        return events

    def finish(self, incomplete: bool, usage: ResponseUsage) -> list[ResponseEvent]:
        """The last events: the open message closed, and the whole response."""
        events = [] if self._output else self._text(self._held, opens=True)  # an output of whitespace, or none
        status: ItemStatus = "incomplete" if incomplete else "completed"
        events += self._close_message(status)
        done = ResponseIncomplete if incomplete else ResponseCompleted
        return [*events, self._event(done, response=self._echo(status, self._output, usage))]

    def failed(self, error: ApiError) -> list[ResponseEvent]:
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        response = self._echo("failed", self._output, error=ResponseError(code=code, message=error.message))
        return [self._event(ResponseFailed, response=response)]

    def _text(self, text: str, opens: bool = False) -> list[ResponseEvent]:
        """text added to the open message, or to a new one if it shows (or opens says so)."""
        events: list[ResponseEvent] = []
        if self._message is None:
            self._held += text
            if not (opens or self._held.strip()):
                return events
            text, self._held = self._held, ""
            events += self._open_message()
        message = self._message
        assert message is not None
        if text:
            message.text += text
            self._output[message.index] = message.item("in_progress")
            events.append(self._event(
                OutputTextDelta, item_id=message.id, output_index=message.index, content_index=0, delta=text,
                logprobs=[],
            ))
        return events

    def _open_message(self) -> list[ResponseEvent]:
        item = message_item("", "in_progress")
        self._message = _OpenMessage(item.id, len(self._output))
        self._output.append(item)
        return [
            self._event(OutputItemAdded, output_index=self._message.index, item=item),
            self._event(ContentPartAdded, item_id=item.id, output_index=self._message.index, content_index=0,
                        part=output_text("")),
        ]

    def _close_message(self, status: ItemStatus) -> list[ResponseEvent]:
        message, self._message = self._message, None
        if message is None:
            return []
        item = self._output[message.index] = message.item(status)
        return [
            self._event(OutputTextDone, item_id=item.id, output_index=message.index, content_index=0,
                        text=message.text, logprobs=[]),
            self._event(ContentPartDone, item_id=item.id, output_index=message.index, content_index=0,
                        part=item.content[0]),
            self._event(OutputItemDone, output_index=message.index, item=item),
        ]

    def _function_call(self, call: dict[str, Any]) -> list[ResponseEvent]:
        item = function_call_item(call, "completed")
        index = len(self._output)
        self._output.append(item)
        added = msgspec.structs.replace(item, arguments="", status="in_progress")
        return [
            self._event(OutputItemAdded, output_index=index, item=added),
            self._event(FunctionCallArgumentsDelta, item_id=item.id, output_index=index, delta=item.arguments),
            self._event(FunctionCallArgumentsDone, item_id=item.id, output_index=index, name=item.name,
                        arguments=item.arguments),
            self._event(OutputItemDone, output_index=index, item=item),
        ]

    def _event(self, event_type: type[ResponseEvent], **fields: Any) -> ResponseEvent:
        return event_type(sequence_number=next(self._sequence), **fields)


@dataclass
class _OpenMessage:
    id: str
    index: int  # in the output
    text: str = ""

    def item(self, status: ItemStatus) -> OutputMessage:
        return message_item(self.text, status, self.id)
