"""CORS, so that browser apps can call the API: every origin by default, as vLLM and llama.cpp's
server allow, or only the configured ones."""

from __future__ import annotations

from aiohttp import web

PREFLIGHT_MAX_AGE_S = 600


def _allowed_origin(request: web.Request, allowed: tuple[str, ...]) -> str | None:
    """The Access-Control-Allow-Origin value for this request, None when it gets no CORS headers."""
    origin = request.headers.get("Origin")
    if origin is None or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


def cors_middleware(allowed: tuple[str, ...]) -> web.Middleware:
    """Answers preflight requests itself, before the API key check (browsers send no credentials on them)."""

    @web.middleware
    async def answer_preflight(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        origin = _allowed_origin(request, allowed)
        if request.method == "OPTIONS" and origin and "Access-Control-Request-Method" in request.headers:
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": request.headers.get(
                        "Access-Control-Request-Headers", "Authorization, Content-Type"
                    ),
                    "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                },
            )
        return await handler(request)

    return answer_preflight


def add_cors_headers(allowed: tuple[str, ...]):
    """An on_response_prepare hook: it reaches streamed responses too, whose headers go out early."""

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = _allowed_origin(request, allowed)
        if origin:
            response.headers["Access-Control-Allow-Origin"] = origin
        if allowed and "*" not in allowed:  # the answer depends on the Origin: caches must key on it
            response.headers["Vary"] = "Origin"

    return add_headers
