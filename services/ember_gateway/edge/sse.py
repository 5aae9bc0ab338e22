"""Server-sent events as OpenAI streams them: `data: {json}` blocks, then `data: [DONE]` (the
Responses API names its events and sends no `[DONE]`)."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # reverse proxies (nginx) would otherwise buffer the stream
}
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def sse_event(payload: Any, name: str | None = None) -> bytes:
    """`data: JSON`, after `event: NAME` when named (the Responses API names each event by its type)."""
    head = b"" if name is None else b"event: " + name.encode() + b"\n"
    return head + b"data: " + _encoder.encode(payload) + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    return response
