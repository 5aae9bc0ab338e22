"""OpenTelemetry plumbing that the gateway and the engine share (`--otlp-traces-endpoint`).

Imported only when tracing is on: with the flag unset no OpenTelemetry module is loaded.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"  # W3C Trace Context's header
_PROPAGATOR = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL spans are posted to: endpoint, or with no path its /v1/traces (as a
    collector's base address, e.g. http://collector:4318, is usually given)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL, got {endpoint!r}")
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def tracer_provider(service_name: str, exporter: SpanExporter) -> TracerProvider:
    """Spans are batched and exported by a background thread, off the request path."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def otlp_exporter(endpoint: str) -> SpanExporter:
    return OTLPSpanExporter(endpoint=traces_url(endpoint))


def parent_context(traceparent: str | None) -> Context | None:
    """The context whose span a traceparent names; None (a new trace) for none or a malformed one."""
    if not traceparent:
        return None
    context = _PROPAGATOR.extract({TRACEPARENT: traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def traceparent_of(span: trace.Span) -> str:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier[TRACEPARENT]
