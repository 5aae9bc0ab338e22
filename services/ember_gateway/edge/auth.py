"""API keys. With user keys (`--api-key`, several comma-separated, or `--api-key-file`, one a line),
every route but the probes', the metrics', the OpenAPI document's and the dashboard's own files
needs `Authorization: Bearer KEY`; the dashboard's page and feed may take it as `?key=KEY`, since a browser's address bar and EventSource
send no header. With admin keys (`--admin-api-key`, `--admin-api-key-file`), the routes that change
what the server runs (ADMIN_PATHS) need one of those, and a user key gets 403 there; an admin key
opens every route. Every comparison runs in constant time over all the keys."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from aiohttp import web

from ember_gateway.edge.errors import ApiError

# Probes, scrapers, API clients and the dashboard's static files (the package's own) need no API key.
_OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/dashboard/dashboard.js", "/dashboard/dashboard.css")
# A browser's address bar and EventSource send no Authorization header: these take the key as ?key=.
_QUERY_KEY_PATHS = ("/dashboard", "/dashboard/events")
# What changes what the server runs: an admin key's, when admin keys are set.
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@dataclass(frozen=True)
class ApiKeys:
    users: tuple[bytes, ...] = ()  # none: user routes are open
    admins: tuple[bytes, ...] = ()  # none: admin routes take a user key (or none, if there are none)

    def error(self, request: web.Request) -> ApiError | None:
        """Why this request may not reach its route (401 or 403), or None."""
        if request.path in _OPEN_PATHS or request.method == "OPTIONS":  # a CORS preflight carries no credentials
            return None
        admin_route = request.path in ADMIN_PATHS and bool(self.admins)
        if not admin_route and not self.users:
            return None
        presented = _presented_keys(request)
        if any([_matches(key, self.admins) for key in presented]):  # noqa: C419 -- every key compared
            return None
        if any([_matches(key, self.users) for key in presented]):  # noqa: C419
            if not admin_route:
                return None
            return ApiError(403, "this route changes what the server runs: it needs an admin API key", type="permission_error",
                            code="admin_key_required")
        how = "send `Authorization: Bearer KEY`"
        if request.path in _QUERY_KEY_PATHS:
            how += f" or open {request.path}?key=KEY"
        return ApiError(401, f"missing or invalid API key ({how})", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _presented_keys(request: web.Request) -> list[bytes]:
    presented = []
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():  # the scheme is case-insensitive (RFC 9110)
        presented.append(token.strip().encode())
    if request.path in _QUERY_KEY_PATHS and request.query.get("key"):
        presented.append(request.query["key"].encode())
    return presented


def _matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    # every key compared, each in constant time: neither which key nor how much of it matched shows
    return any([hmac.compare_digest(presented, key) for key in keys])  # noqa: C419 -- no short-circuit on purpose


def auth_middleware(keys: ApiKeys) -> web.Middleware:
    @web.middleware
    async def check_api_key(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        error = keys.error(request)
        if error is not None:
            raise error
        return await handler(request)

    return check_api_key
