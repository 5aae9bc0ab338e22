"""The engine's OpenTelemetry spans (`--otlp-traces-endpoint`): per request, its time in the queue,
each prompt chunk's step, its decode, and each preemption's wait.

As a request runs only timestamps are kept, once per step and request (not per token); its spans
are made and handed to the exporter when it finishes. Its parent is the gateway's span, named by
the traceparent its Generate carries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider

from ember_core.engine.scheduler import SchedulerOutput
from ember_core.engine.sequence import Sequence
from ember_core.tracing import parent_context
from ember_proto import FinishReason, Generate, RequestDelta


@dataclass
class _Interval:
    name: str  # queue, prefill, decode or preempted: a child span's name
    start_ns: int
    end_ns: int = 0  # 0: still open
    tokens: int = 0  # a prefill chunk's


@dataclass
class _Timeline:
    generate: Generate
    parent: Context | None
    start_ns: int
    intervals: list[_Interval] = field(default_factory=list)
    waiting: _Interval | None = None  # the queue or a preemption, until the next step schedules it
    decode: _Interval | None = None
    seq: Sequence | None = None  # once scheduled: its token counts are read at the finish


class EngineTracer:
    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("ember.engine")
        self._timelines: dict[str, _Timeline] = {}
        self._step_chunks: list[_Interval] = []  # the prompt chunks of the step running

    def started(self, generate: Generate) -> None:
        now = time.time_ns()
        timeline = _Timeline(generate, parent_context(generate.traceparent), now)
        timeline.waiting = _Interval("queue", now)
        timeline.intervals.append(timeline.waiting)
        self._timelines[generate.request_id] = timeline

    def scheduled(self, decision: SchedulerOutput) -> None:
        """A step's schedule, before the step runs (Engine.schedule_observer)."""
        now = time.time_ns()
        for seq, num_tokens in zip(decision.seqs, decision.num_scheduled_tokens):
            timeline = self._timelines.get(seq.request_id)
            if timeline is None:
                continue
            timeline.seq = seq
            if timeline.waiting is not None:
                timeline.waiting.end_ns = now
                timeline.waiting = None
            if seq.num_output_tokens == 0 or seq.num_uncomputed_tokens > 1:  # the prompt (again, after a preemption)
                chunk = _Interval("prefill", now, tokens=num_tokens)
                timeline.intervals.append(chunk)
                self._step_chunks.append(chunk)
            elif timeline.decode is None:
                timeline.decode = _Interval("decode", now)
                timeline.intervals.append(timeline.decode)
        for seq in decision.preempted:
            timeline = self._timelines.get(seq.request_id)
            if timeline is not None:
                timeline.waiting = _Interval("preempted", now)
                timeline.intervals.append(timeline.waiting)

    def step_ended(self, deltas: list[RequestDelta]) -> None:
        """The step's prompt chunks end now; the requests it finished get their spans."""
        now = time.time_ns()
        for chunk in self._step_chunks:
            chunk.end_ns = now
        self._step_chunks.clear()
        for delta in deltas:
            if delta.finish_reason is not None:
                self._finished(delta.request_id, delta.finish_reason, now)

    def _finished(self, request_id: str, reason: FinishReason, now: int) -> None:
        """Emit the request's spans (nothing for a request this tracer did not see start)."""
        timeline = self._timelines.pop(request_id, None)
        if timeline is None:
            return
        sampling = timeline.generate.sampling
        seq = timeline.seq
        intervals = timeline.intervals
        for interval in intervals:
            interval.end_ns = interval.end_ns or now

        def seconds(name: str) -> float:
            return sum(i.end_ns - i.start_ns for i in intervals if i.name == name) / 1e9

        span = self._tracer.start_span(
            "engine request", context=timeline.parent, kind=trace.SpanKind.SERVER, start_time=timeline.start_ns,
            attributes={
                "gen_ai.request.id": request_id,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.usage.prompt_tokens": len(timeline.generate.prompt_token_ids),
                "gen_ai.usage.completion_tokens": 0 if seq is None else seq.num_output_tokens,
                "gen_ai.latency.time_in_queue": seconds("queue"),
                "gen_ai.latency.time_in_model_prefill": seconds("prefill"),
                "gen_ai.latency.time_in_model_decode": seconds("decode"),
                "ember.finish_reason": reason.label,
                "ember.preemptions": sum(i.name == "preempted" for i in intervals),
            },
        )
        context = trace.set_span_in_context(span)
        for interval in intervals:
            attributes = {"ember.tokens": interval.tokens} if interval.name == "prefill" else None
            child = self._tracer.start_span(interval.name, context=context, start_time=interval.start_ns, attributes=attributes)
            child.end(end_time=interval.end_ns)
        span.end(end_time=now)

    def shutdown(self) -> None:
        """Export the spans still batched (the engine is stopping)."""
        self._provider.shutdown()
