"""The engine requests behind one HTTP request, consumed as text updates per choice, or (embedding
requests) as one embedding each.

Used as a context manager: leaving it (normally, on an error, or when the handler is cancelled
because the client went away) aborts every engine request that has not finished, synchronously,
in that same event-loop turn.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Self

from ember_core.output_processor import ChoiceRequest, ChoiceUpdate, OutputProcessor
from ember_gateway.edge.errors import ApiError, engine_unavailable
from ember_gateway.engines.inflight import EngineFailure, Output
from ember_gateway.engines.pool import EnginePool
from ember_gateway.engines.served_model import ServedModel
from ember_gateway.observability.metrics import GatewayMetrics
from ember_gateway.observability.trace_context import CURRENT_TRACE
from ember_proto import EmbedOptions, FinishReason, Generate, RequestDelta


@dataclass
class _Choice:
    request_id: str
    prompt_length: int
    num_tokens: int = 0
    last_token_at: float | None = None


class Generation:
    def __init__(
        self,
        pool: EnginePool,
        model: ServedModel,
        metrics: GatewayMetrics,
        *,
        request_id: str,
        arrived_at: float,
        choices: list[ChoiceRequest],
        timeout: float | None,
        max_pending: int,
        embed: EmbedOptions | None = None,
        requests_param: str = "n",
    ) -> None:
        """embed: the choices are embedding requests (max_tokens 0); requests_param: the field that
        makes the engine requests many (named when there are too many)."""
        self._pool = pool
        self._model = model
        self._metrics = metrics
        self._requests = choices
        self._timeout = timeout
        self._max_pending = max_pending
        self._embed = embed
        self._requests_param = requests_param
        self._arrived_at = arrived_at  # time.monotonic() when the HTTP request arrived
        self._deadline = None if timeout is None else self._arrived_at + timeout
        self._choices = [_Choice(f"{request_id}-{index}", len(choice.prompt_ids)) for index, choice in enumerate(choices)]
        self._processor = OutputProcessor(model.tokenizer, choices, model.card.stop_token_ids)
        self._queue: asyncio.Queue[Output] | None = None
        self._trace = CURRENT_TRACE.get()
        self._request_id = request_id

    @property
    def completion_tokens(self) -> int:
        return sum(choice.num_tokens for choice in self._choices)

    def __enter__(self) -> Self:
        if len(self._requests) > self._max_pending:
            raise ApiError(
                400,
                f"this request needs {len(self._requests)} engine requests (prompts x n), more than this gateway's "
                f"limit of {self._max_pending} in flight",
                param=self._requests_param,
            )
        if self._pool.num_in_flight + len(self._requests) > self._max_pending:
            raise ApiError(
                429,
                f"the gateway is at its limit of {self._max_pending} requests in flight; retry shortly",
                type="rate_limit_error",
                code="too_many_pending_requests",
                headers={"Retry-After": "1"},
            )
        arrival_time = time.time() - (time.monotonic() - self._arrived_at)
        deadline = None if self._timeout is None else arrival_time + self._timeout
        traceparent = None
        if self._trace is not None:
            traceparent = self._trace.generation_started(self._request_id, self._model.name, self._requests)
        self._queue = self._pool.submit(
            [
                Generate(
                    request_id=choice.request_id,
                    prompt_token_ids=request.prompt_ids,
                    sampling=request.params.to_wire(),
                    arrival_time=arrival_time,
                    deadline=deadline,
                    embed=self._embed,
                    traceparent=traceparent,
                    adapter=self._model.adapter,
                )
                for choice, request in zip(self._choices, self._requests)
            ],
            self._model.name,
        )
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.release([self._choices[index].request_id for index in self._processor.unfinished()])
        if self._trace is not None:
            self._trace.generation_ended(self.completion_tokens)

    async def next_update(self) -> ChoiceUpdate | None:
        """The next update of any choice; None once every choice has finished. Raises ApiError
        when the engine rejects or loses a request, or the request times out."""
        while self._processor.num_unfinished:
            index, item, previous_message_at = await self._next_output()
            if self._processor.finished(index):
                continue  # queued before a stop string ended the choice
            update = self._processor.process(index, self._delta(item))
            self._record(self._choices[index], update, previous_message_at)
            if update.text or update.token_ids or update.finish_reason:
                return update
        return None

    async def embeddings(self) -> list[bytes]:
        """Each embedding request's vector (RequestDelta.embedding), in submission order, once every
        one has come. Raises ApiError as next_update does."""
        embeddings = [b""] * len(self._choices)
        while self._processor.num_unfinished:
            index, item, _ = await self._next_output()
            delta = self._delta(item)
            self._processor.process(index, delta)
            embeddings[index] = delta.embedding
            self._metrics.prompt_tokens.labels(self._model.name).inc(self._choices[index].prompt_length)
            self._record_finish(FinishReason.STOP.label)
        return embeddings

    def _delta(self, item: RequestDelta | EngineFailure) -> RequestDelta:
        """item, unless the engine rejected, lost or aborted its request: then the ApiError to answer."""
        if isinstance(item, EngineFailure):
            if item.status == 503:
                raise engine_unavailable(item.message)
            raise ApiError(item.status, item.message, type=_error_type(item.status))
        if item.finish_reason is FinishReason.ABORT:
            raise self._timeout_error() if self._past_deadline() else ApiError(
                503, "the engine aborted the request", type="service_unavailable_error"
            )
        return item

    async def _next_output(self) -> Output:
        assert self._queue is not None
        if self._deadline is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), self._deadline - time.monotonic())
        except TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            raise self._timeout_error() from None

    def _record(self, choice: _Choice, update: ChoiceUpdate, previous_message_at: float) -> None:
        if update.ended_by_stop_string:
            self._pool.release([choice.request_id])
        if update.token_ids:
            self._record_tokens(choice, len(update.token_ids), previous_message_at)
        if update.finish_reason is not None:
            self._record_finish(update.finish_reason.label)

    def _record_tokens(self, choice: _Choice, count: int, previous_message_at: float) -> None:
        now = time.monotonic()
        name = self._model.name
        if choice.last_token_at is None:
            self._metrics.time_to_first_token.labels(name).observe(now - self._arrived_at)
            if self._trace is not None and not self.completion_tokens:
                self._trace.first_token(now - self._arrived_at)
            # the engine's message before the first token's: about when the step that computed it began
            self._metrics.request_queue_time.labels(name).observe(max(0.0, previous_message_at - self._arrived_at))
            self._metrics.prompt_tokens.labels(name).inc(choice.prompt_length)
        else:
            self._metrics.inter_token_latency.labels(name).observe(now - choice.last_token_at)
        choice.last_token_at = now
        choice.num_tokens += count
        self._metrics.generation_tokens.labels(name).inc(count)

    def _record_finish(self, finish_reason: str) -> None:
        name = self._model.name
        self._metrics.e2e_request_latency.labels(name).observe(time.monotonic() - self._arrived_at)
        self._metrics.request_success.labels(name, finish_reason).inc()

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _timeout_error(self) -> ApiError:
        return ApiError(
            504,
            f"the request did not finish within the gateway's request timeout of {self._timeout:g} s",
            type="timeout_error",
            code="request_timeout",
        )


def _error_type(status: int) -> str:
    return "invalid_request_error" if status == 400 else "server_error"
