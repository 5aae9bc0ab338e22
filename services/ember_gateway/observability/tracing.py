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

from ember_core.tracing import TRACEPARENT, parent_context
from ember_gateway.observability.request_trace import RequestTrace
from ember_gateway.observability.trace_context import CURRENT_TRACE


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
