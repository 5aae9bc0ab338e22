"""`Expect: 100-continue`, answered before the client uploads its body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import HttpVersion11, hdrs, web

from ember_gateway.edge.auth import ApiKeys
from ember_gateway.edge.errors import ApiError
from ember_gateway.edge.intake import check_framing


def expect_handler(max_body_bytes: int, keys: ApiKeys) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """Answers `Expect: 100-continue` (curl sends it for bodies over 1 MB) before the client uploads:
    a request that would be refused anyway (no valid API key, a body refused by check_framing) gets
    its error instead of `100 Continue`, on a connection then closed, since its body never comes."""

    async def expect_continue(request: web.Request) -> web.StreamResponse | None:
        error = keys.error(request)
        if error is None:
            try:
                check_framing(request, max_body_bytes)
            except ApiError as refused:
                error = refused
        if error is None and request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
            error = ApiError(417, f"unsupported Expect: {request.headers.get(hdrs.EXPECT)!r} (only 100-continue)")
        if error is not None:
            response = error.response()
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()  # sent: close now, where aiohttp would wait up to 10 s for the body
            return response
        if request.version >= HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the interim response is not part of the response's size
        return None

    return expect_continue
