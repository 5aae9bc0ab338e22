"""The engine requests behind one HTTP request, consumed as text updates per choice.

Used as a context manager: leaving it (normally, on an error, or when the handler is cancelled
because the client went away) aborts every engine request that has not finished, synchronously,
in that same event-loop turn.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import TracebackType

from ember_core.tokenizer import OutputText, StopRules
from ember_gateway.engine_client import EngineClient, EngineFailure, Output, ServedModel
from ember_gateway.errors import ApiError, engine_unavailable
from ember_gateway.metrics import GatewayMetrics
from ember_proto import FinishReason, Generate, RequestDelta, SamplingOptions, TokenLogprob


@dataclass(frozen=True)
class ChoicePlan:
    """One engine request: one choice of one prompt."""

    prompt_ids: list[int]
    sampling: SamplingOptions


@dataclass(frozen=True)
class ChoiceUpdate:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # "stop" or "length" on a choice's last update
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1, 2, ... (first update)

    def has_content(self, logprobs: bool, token_ids: bool) -> bool:
        """Whether a stream chunk of this update would carry anything: text, or logprobs or
        token ids when the client asked for them."""
        return bool(self.text or (logprobs and self.logprobs) or (token_ids and self.token_ids))


@dataclass
class _Choice:
    request_id: str
    prompt_length: int
    text: OutputText
    num_tokens: int = 0
    last_token_at: float | None = None
    finished: bool = False


class Generation:
    def __init__(
        self,
        client: EngineClient,
        model: ServedModel,
        metrics: GatewayMetrics,
        *,
        request_id: str,
        arrived_at: float,
        plans: list[ChoicePlan],
        stop_rules: StopRules,
        timeout: float | None,
        max_pending: int,
    ) -> None:
        self._client = client
        self._model = model
        self._metrics = metrics
        self._plans = plans
        self._timeout = timeout
        self._max_pending = max_pending
        self._arrived_at = arrived_at  # time.monotonic() when the HTTP request arrived
        self._deadline = None if timeout is None else self._arrived_at + timeout
        self._choices = [
            _Choice(f"{request_id}-{index}", len(plan.prompt_ids), OutputText(model.tokenizer, stop_rules))
            for index, plan in enumerate(plans)
        ]
        self._num_unfinished = len(plans)
        self._queue: asyncio.Queue[Output] | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(choice.num_tokens for choice in self._choices)

    def __enter__(self) -> Generation:
        if len(self._plans) > self._max_pending:
            raise ApiError(
                400,
                f"this request needs {len(self._plans)} engine requests (prompts x n), more than this gateway's "
                f"limit of {self._max_pending} in flight",
                param="n",
            )
        if self._client.num_in_flight + len(self._plans) > self._max_pending:
            raise ApiError(
                429,
                f"the gateway is at its limit of {self._max_pending} requests in flight; retry shortly",
                type="rate_limit_error",
                code="too_many_pending_requests",
                headers={"Retry-After": "1"},
            )
        arrival_time = time.time() - (time.monotonic() - self._arrived_at)
        deadline = None if self._timeout is None else arrival_time + self._timeout
        self._queue = self._client.submit(
            [
                Generate(
                    request_id=choice.request_id,
                    prompt_token_ids=plan.prompt_ids,
                    sampling=plan.sampling,
                    arrival_time=arrival_time,
                    deadline=deadline,
                )
                for choice, plan in zip(self._choices, self._plans)
            ]
        )
        return self

    def __exit__(self, *exc_info: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._client.release([choice.request_id for choice in self._choices if not choice.finished])

    async def next_update(self) -> ChoiceUpdate | None:
        """The next update of any choice; None once every choice has finished. Raises ApiError
        when the engine rejects or loses a request, or the request times out."""
        while self._num_unfinished:
            index, item, step_started_at = await self._next_output()
            if self._choices[index].finished:
                continue  # queued before a stop string ended the choice
            if isinstance(item, EngineFailure):
                if item.status == 503:
                    raise engine_unavailable(item.message)
                raise ApiError(item.status, item.message, type=_error_type(item.status))
            if item.finish_reason == FinishReason.ABORT:
                raise self._timeout_error() if self._past_deadline() else ApiError(
                    503, "the engine aborted the request", type="service_unavailable_error"
                )
            update = self._apply(index, item, step_started_at)
            if update.text or update.token_ids or update.finish_reason:
                return update
        return None

    async def _next_output(self) -> Output:
        assert self._queue is not None
        if self._deadline is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), self._deadline - time.monotonic())
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            raise self._timeout_error() from None

    def _apply(self, index: int, delta: RequestDelta, step_started_at: float) -> ChoiceUpdate:
        choice = self._choices[index]
        token_ids = delta.new_token_ids
        final = delta.finish_reason is not None
        match = choice.text.push(token_ids, final, stop_token=delta.finish_reason == FinishReason.STOP)
        if match.stopped:
            finish_reason: str | None = FinishReason.STOP.label
            self._client.release([choice.request_id])
        else:
            finish_reason = delta.finish_reason.label if final else None  # an abort ended the request before
        if token_ids:
            self._record_tokens(choice, len(token_ids), step_started_at)
        if finish_reason is not None:
            choice.finished = True
            self._num_unfinished -= 1
            self._record_finish(finish_reason)
        return ChoiceUpdate(
            index=index,
            text=match.text,
            token_ids=token_ids,
            logprobs=delta.logprobs,
            finish_reason=finish_reason,
            prompt_logprobs=delta.prompt_logprobs,
        )

    def _record_tokens(self, choice: _Choice, count: int, step_started_at: float) -> None:
        now = time.monotonic()
        name = self._model.name
        if choice.last_token_at is None:
            self._metrics.time_to_first_token.labels(name).observe(now - self._arrived_at)
            self._metrics.request_queue_time.labels(name).observe(max(0.0, step_started_at - self._arrived_at))
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
