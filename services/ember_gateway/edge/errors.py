"""OpenAI-style errors: one exception type for every client-visible failure, and its JSON body
(ErrorResponse, api/response_bodies.py)."""

from __future__ import annotations

import json

import msgspec
from aiohttp import web

from ember_gateway.api.response_bodies import ErrorDetail, ErrorResponse


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close_connection: bool = False,
    ) -> None:
        """close_connection: the connection ends after this answer (the request was not read whole)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.close_connection = close_connection

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def json_text(self) -> str:
        """The body of an error answer as json.dumps writes it (`", "` and `": "`, non-ASCII escaped),
        as these answers always were; a body or stream already sent as 200 has it msgspec-encoded."""
        return json.dumps(msgspec.to_builtins(self.body()))

    def response(self) -> web.Response:
        response = web.json_response(text=self.json_text(), status=self.status, headers=self.headers)
        if self.close_connection:
            response.force_close()
        return response


def engine_unavailable(message: str = "no engine is connected and ready; try again shortly") -> ApiError:
    return ApiError(503, message, type="service_unavailable_error", code="engine_unavailable")


def internal_error() -> ApiError:
    return ApiError(500, "internal server error", type="server_error", code="internal_error")


def from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    """The errors aiohttp raises itself (routing, body size) as OpenAI errors."""
    where = f"{request.method} {request.path}"
    if exc.status == 404:
        return ApiError(404, f"no such route: {where}", code="not_found")
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"method not allowed: {where} (allowed: {allowed})"
        return ApiError(405, message, code="method_not_allowed", headers={"Allow": allowed})
    if exc.status == 413:
        return ApiError(413, exc.text or "request body too large", code="request_too_large")
    return ApiError(exc.status, exc.reason, type="invalid_request_error" if exc.status < 500 else "server_error")
