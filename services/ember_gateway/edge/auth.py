"""The API key (`--api-key`): every route but the probes', the metrics', the OpenAPI document's and
the dashboard's own files needs `Authorization: Bearer KEY`; the dashboard's page and feed may take
it as `?key=KEY`, since a browser's address bar and EventSource send no header."""

from __future__ import annotations

import hmac

from aiohttp import web

from ember_gateway.edge.errors import ApiError

# Probes, scrapers, API clients and the dashboard's static files (the package's own) need no API key.
_OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/dashboard/dashboard.js", "/dashboard/dashboard.css")
# A browser's address bar and EventSource send no Authorization header: these take the key as ?key=.
_QUERY_KEY_PATHS = ("/dashboard", "/dashboard/events")


def api_key_bytes(api_key: str | None) -> bytes | None:
    return api_key.encode() if api_key else None


def api_key_error(request: web.Request, expected: bytes | None) -> ApiError | None:
    # A CORS preflight never carries credentials: the CORS layer answers it, or routing does.
    if expected is None or request.path in _OPEN_PATHS or request.method == "OPTIONS":
        return None
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    # The scheme is case-insensitive (RFC 9110); the key is compared in constant time.
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected):
        return None
    how = "send `Authorization: Bearer KEY`"
    if request.path in _QUERY_KEY_PATHS:
        if hmac.compare_digest(request.query.get("key", "").encode(), expected):
            return None
        how += f" or open {request.path}?key=KEY"
    return ApiError(
        401, f"missing or invalid API key ({how})", code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def auth_middleware(api_key: str | None) -> web.Middleware:
    expected = api_key_bytes(api_key)

    @web.middleware
    async def check_api_key(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        error = api_key_error(request, expected)
        if error is not None:
            raise error
        return await handler(request)

    return check_api_key
