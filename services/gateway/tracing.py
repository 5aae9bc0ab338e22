"""OpenTelemetry spans of the gateway's requests (`--otlp-traces-endpoint`), one trace per request.

A POST's span is the trace's root, or the child of the span its `traceparent` header names. Under it,
as the request goes: `validate` (the body read and decoded, the model found), `tokenize` (the chat
template, the prompts' tokens, the sampling parameters), and `generate` (submitted to the engine,
the routing decision and the engine chosen, the first token, the stream, the usage), whose context
each Generate carries on the wire so that the engine's spans are its children.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from ember_core.output_processor import ChoiceRequest
from ember_core.tracing import TRACEPARENT, parent_context, traceparent_of
from ember_gateway.trace_context import CURRENT_TRACE


class RequestTrace:
    def __init__(self, tracer: trace.Tracer, span: trace.Span, start_ns: int) -> None:
        self._tracer = tracer
        self._context = trace.set_span_in_context(span)
        self._mark_ns = start_ns  # where the next step's span starts
        self._generate: trace.Span | None = None

    def step_done(self, name: str) -> None:
        """A child span from the end of the previous step (or the request's start) to now."""
        now = time.time_ns()
        self._tracer.start_span(name, context=self._context, start_time=self._mark_ns).end(end_time=now)
        self._mark_ns = now

    def generation_started(self, request_id: str, model: str, choices: list[ChoiceRequest]) -> str:
        """Opens the `generate` span (after `tokenize`); its traceparent, for the Generates."""
        self.step_done("tokenize")
        params = choices[0].params
        self._generate = self._tracer.start_span("generate", context=self._context, attributes={
            "gen_ai.request.id": request_id,
            "gen_ai.request.model": model,
            "gen_ai.request.n": len(choices),
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.prompt_tokens": sum(len(choice.prompt_ids) for choice in choices),
        })
        return traceparent_of(self._generate)

    def routed(self, engine: str, reason: str) -> None:
        """reason: the router's (router.REASONS), or `only` where one engine could take it."""
        if self._generate is not None:
            self._generate.set_attributes({"ember.engine": engine, "ember.routing.reason": reason})

    def first_token(self, time_to_first_token: float) -> None:
        if self._generate is not None:
            self._generate.add_event("first token")
            self._generate.set_attribute("gen_ai.latency.time_to_first_token", time_to_first_token)

    def generation_ended(self, completion_tokens: int) -> None:
        if self._generate is not None:
            self._generate.set_attribute("gen_ai.usage.completion_tokens", completion_tokens)
            self.close()
            self._mark_ns = time.time_ns()

    def close(self) -> None:
        """Ends the `generate` span if a submission that failed (no engine: 503) left it open."""
        if self._generate is not None:
            self._generate.end()
            self._generate = None


def add_tracing(app: web.Application, provider: TracerProvider) -> None:
    """Traces the app's POST requests (the API; not probes and scrapes); spans still batched are
    exported when the app stops. Call before the app starts."""
    tracer = provider.get_tracer("ember.gateway")

    @web.middleware
    async def trace_request(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        if request.method != "POST":
            return await handler(request)
        start_ns = time.time_ns()
        span = tracer.start_span(
            f"POST {request.path}", context=parent_context(request.headers.get(TRACEPARENT)),
            kind=trace.SpanKind.SERVER, start_time=start_ns,
            attributes={"http.request.method": "POST", "url.path": request.path},
        )
        request_trace = RequestTrace(tracer, span, start_ns)
        token = CURRENT_TRACE.set(request_trace)
        try:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(trace.StatusCode.ERROR)
            return response
        finally:
            CURRENT_TRACE.reset(token)
            request_trace.close()
            span.end()

    async def flush(_: web.Application) -> None:
        await asyncio.to_thread(provider.shutdown)  # it may wait on the collector: off the event loop

    app.middlewares.insert(0, trace_request)  # outermost: the errors middleware's answers are traced too
    app.on_cleanup.append(flush)
