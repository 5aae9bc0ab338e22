"""The gateway's HTTP connections, defended for an exposed edge: aiohttp's request handler with a
deadline for the request line and headers, an idle keep-alive limit and a cap on open connections
(refused with 503 at accept), and a client that half-closes after a complete request still answered
(client_half_closed: respond.py then answers a non-streamed request in a form that tells a
half-closed client from a gone one).
The body's minimum rate is read in intake.py, which reads the body.

aiohttp has one timer for all of this: its keep-alive deadline, which closes a connection that is
waiting for a request's headers (never one whose request is being handled, so streams are never
cut). EdgeRequestHandler moves that deadline: the idle limit after a response, the header limit
from a request's first byte. It relies on RequestHandler internals of aiohttp 3.11-3.14
(tests/gateway/edge/test_http_edge.py exercises each behaviour).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ember_gateway.edge.errors import ApiError


def client_half_closed(request: web.BaseRequest) -> asyncio.Event:
    """Set once the client has shut its side of the connection after a complete request."""
    protocol = request.protocol
    return protocol.half_closed if isinstance(protocol, EdgeRequestHandler) else asyncio.Event()


@dataclass(frozen=True)
class EdgeLimits:
    header_timeout: float  # seconds from a request's first byte to the end of its headers
    body_timeout: float  # longest wait for the next bytes of a request body (a minimum body rate)
    keepalive_timeout: float  # an idle connection between requests (and before its first) is closed
    max_connections: int  # open connections; beyond: 503 at accept


def _busy_response() -> bytes:
    error = ApiError(503, "the gateway has too many open connections; retry shortly", type="service_unavailable_error",
                     code="too_many_connections")
    body = error.json_text().encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


_BUSY = _busy_response()


class EdgeRequestHandler(RequestHandler):
    def __init__(self, manager: web.Server, *, edge_limits: EdgeLimits, **kwargs: Any) -> None:
        super().__init__(manager, keepalive_timeout=edge_limits.keepalive_timeout, **kwargs)
        self._limits = edge_limits
        self._reading_headers = False
        self.half_closed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert self._manager is not None
        if len(self._manager.connections) >= self._limits.max_connections:
            transport.write(_BUSY)  # type: ignore[attr-defined]
            transport.close()
            self._manager = None  # never served: connection_lost has nothing to undo
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._reading_headers and self._idle():
            self._reading_headers = True
            self._move_deadline(self._limits.header_timeout)
        super().data_received(data)
        if self._reading_headers and not self._idle():  # the headers are in: the request is handled
            self._reading_headers = False

    def eof_received(self) -> bool:
        """A client that half-closes (shutdown(SHUT_WR)) after a complete request gets its answer,
        then the connection closes; one that closes while idle or mid-request is gone."""
        # a request is parsed, waiting or being handled (no waiter: start() is past waiting for one)
        if self._messages or (self._waiter is None and self._request_count > 0):
            self.close()  # after this response
            self.half_closed.set()
            return True  # keep the write side open
        return False

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """What aiohttp answers itself (a request it cannot parse: a bad request line, oversized
        headers) as an OpenAI error, logged in one line rather than with a traceback."""
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        reason = message or (str(exc) if exc else "") or HTTPStatus(status).phrase
        self.logger.info("refused a malformed request from %s: %s", request.remote, reason)
        return ApiError(status, f"malformed HTTP request: {reason}", close_connection=True).response()

    def _idle(self) -> bool:
        """Waiting for a request's headers: no request parsed and none being handled."""
        return self._waiter is not None and not self._waiter.done() and not self._messages

    def _move_deadline(self, seconds: float) -> None:
        loop = self._loop
        self._next_keepalive_close_time = loop.time() + seconds
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
        self._keepalive_handle = loop.call_at(self._next_keepalive_close_time, self._process_keepalive)


class EdgeServer(web.Server):
    def __call__(self) -> RequestHandler:
        return EdgeRequestHandler(self, loop=self._loop, **self._kwargs)


class EdgeAppRunner(web.AppRunner):
    """An AppRunner whose connections are EdgeRequestHandlers (keyword edge_limits)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = EdgeServer  # the same server; only the handler it makes per connection differs
        return server
