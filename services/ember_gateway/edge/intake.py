"""Validation, the first step of a request: read the HTTP body, decode it against its schema,
and find the engines' model it names, which must serve the request's task."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ember_gateway.api.request_bodies import Body, GenerationRequest, decode_body
from ember_gateway.edge.errors import ApiError
from ember_gateway.engines.served_model import ServedModel
from ember_gateway.observability.trace_context import CURRENT_TRACE
from ember_gateway.state import STATE, GatewayState

# What aiohttp decodes (br and zstd with the Brotli and backports.zstd packages); any other body
# would be read as it is, compressed.
_CONTENT_ENCODINGS = ("identity", "gzip", "deflate", "br", "zstd")

logger = logging.getLogger(__name__)


async def accept(request: web.Request, body_type: type[Body]) -> tuple[GatewayState, ServedModel, Body]:
    state = request.app[STATE]
    check_framing(request, state.config.max_body_bytes)
    await state.await_models()  # no engine: 503 whatever the body
    raw = await read_body(request, state.config.max_body_bytes, state.config.body_timeout)
    body = decode_body(raw, body_type)
    model = await state.await_model(body.model)
    if isinstance(body, GenerationRequest) and model.task == "embed":
        raise ApiError(400, f"the model `{model.name}` serves embeddings only (its engine runs --task embed): "
                       "use /v1/embeddings", param="model")
    if (trace := CURRENT_TRACE.get()) is not None:
        trace.step_done("validate")
    return state, model, body


def check_framing(request: web.Request, max_body_bytes: int) -> None:
    """Refuse a body before reading a byte of it: not JSON (a browser form cannot post without a
    CORS preflight then), an encoding aiohttp cannot undo, or a declared length over the limit."""
    if request.content_type != "application/json":
        raise ApiError(415, f"the request body must be application/json, not {request.content_type}",
                       code="unsupported_media_type", close_connection=True)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in _CONTENT_ENCODINGS:
        raise ApiError(415, f"unsupported Content-Encoding {encoding!r}: use one of {', '.join(_CONTENT_ENCODINGS)}",
                       close_connection=True)
    if (request.content_length or 0) > max_body_bytes:
        raise ApiError(413, f"request body of {request.content_length} bytes is over the limit of {max_body_bytes}",
                       code="request_too_large", close_connection=True)


async def read_body(request: web.Request, max_body_bytes: int, body_timeout: float) -> bytes:
    """The decoded body, each read waiting at most body_timeout for more bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), body_timeout)
        except TimeoutError:
            raise ApiError(408, f"the request body stalled: no bytes for {body_timeout:g} s", code="request_timeout",
                           close_connection=True) from None
        except web.RequestPayloadError as exc:  # e.g. a body that is not what its Content-Encoding says
            request.content.feed_eof()  # nothing more is read from it: aiohttp must not drain it
            cause = exc.__cause__ or exc
            message = getattr(cause, "message", None) or str(cause)
            logger.info("a request body from %s could not be decoded: %s", request.remote, message)
            raise ApiError(400, f"the request body could not be decoded: {message}", close_connection=True) from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_body_bytes:
            raise ApiError(413, f"request body is over the limit of {max_body_bytes} bytes", code="request_too_large",
                           close_connection=True)
        chunks.append(chunk)
