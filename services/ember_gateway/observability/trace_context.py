"""The HTTP request's trace, for the steps that add to it: set by tracing.py's middleware when
tracing is on; otherwise always None, which costs its readers one ContextVar lookup."""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from ember_gateway.observability.request_trace import RequestTrace

CURRENT_TRACE: ContextVar[RequestTrace | None] = ContextVar("ember_request_trace", default=None)
