"""Validation, the first step of a request: read the HTTP body, decode it against its schema,
and find the engines' model it names."""

from __future__ import annotations

from aiohttp import web

from ember_gateway.engine_client import ServedModel
from ember_gateway.errors import ApiError
from ember_gateway.schemas import Body, decode_body
from ember_gateway.state import STATE, GatewayState

# What aiohttp decodes (br and zstd with the Brotli and backports.zstd packages); any other body
# would be read as it is, compressed.
_CONTENT_ENCODINGS = ("identity", "gzip", "deflate", "br", "zstd")


async def accept(request: web.Request, body_type: type[Body]) -> tuple[GatewayState, ServedModel, Body]:
    state = request.app[STATE]
    await state.await_models()  # no engine: 503 whatever the body
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in _CONTENT_ENCODINGS:
        raise ApiError(415, f"unsupported Content-Encoding {encoding!r}: use one of {', '.join(_CONTENT_ENCODINGS)}")
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:  # e.g. a body that is not what its Content-Encoding says
        cause = exc.__cause__ or exc
        raise ApiError(400, f"the request body could not be read: {getattr(cause, 'message', cause)}") from None
    body = decode_body(raw, body_type)
    return state, await state.await_model(body.model), body
