"""The aiohttp application: routes, middlewares, and the engine pool's lifetime."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import HttpVersion11, hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember_gateway.chat import create_chat_completion
from ember_gateway.completions import create_completion
from ember_gateway.config import GatewayConfig
from ember_gateway.connections import EdgeAppRunner, EdgeLimits
from ember_gateway.cors import add_cors_headers, cors_middleware
from ember_gateway.dashboard import dashboard_asset, dashboard_events, dashboard_page
from ember_gateway.embeddings import create_embeddings
from ember_gateway.engine_client import ServedModel
from ember_gateway.engine_pool import EnginePool
from ember_gateway.errors import ApiError, engine_unavailable, from_http_exception, internal_error
from ember_gateway.intake import check_framing
from ember_gateway.metrics import GatewayMetrics
from ember_gateway.openapi import openapi_document
from ember_gateway.respond import json_response
from ember_gateway.responses import Health, Model, ModelList
from ember_gateway.responses_api import create_response
from ember_gateway.state import STATE, GatewayState
from ember_gateway.tokenize import detokenize, tokenize

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)

# Probes, scrapers, API clients and the dashboard's static files (the package's own) need no API key.
_OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/dashboard/dashboard.js", "/dashboard/dashboard.css")
# A browser's address bar and EventSource send no Authorization header: these take the key as ?key=.
_QUERY_KEY_PATHS = ("/dashboard", "/dashboard/events")


def create_app(
    config: GatewayConfig, pool: EnginePool | None = None, tracer_provider: TracerProvider | None = None
) -> web.Application:
    """tracer_provider: where the requests' spans go (tests); by default, when
    config.otlp_traces_endpoint is set, batched to it."""
    pool = pool or EnginePool(
        list(config.engine_addresses),
        routing=config.routing,
        model_name=config.model_name,
        watchdog_s=config.engine_timeout,
        resume_wait_s=config.engine_resume_wait,
    )
    app = web.Application(
        middlewares=[_errors_middleware, cors_middleware(config.allowed_origins), _auth_middleware(config.api_key)],
        client_max_size=config.max_body_bytes,
    )
    app.on_response_prepare.append(add_cors_headers(config.allowed_origins))
    app[STATE] = GatewayState(config, pool, GatewayMetrics(pool))
    expect = _expect_handler(config.max_body_bytes, _api_key_bytes(config.api_key))
    app.add_routes(
        [
            web.post("/v1/completions", create_completion, expect_handler=expect),
            web.post("/v1/chat/completions", create_chat_completion, expect_handler=expect),
            web.post("/v1/responses", create_response, expect_handler=expect),
            web.post("/v1/embeddings", create_embeddings, expect_handler=expect),
            web.post("/tokenize", tokenize, expect_handler=expect),
            web.post("/detokenize", detokenize, expect_handler=expect),
            web.get("/v1/models", list_models),
            web.get("/v1/models/{model:.+}", get_model),
            web.get("/health", health),
            web.get("/metrics", metrics),
            web.get("/openapi.json", openapi_document),
            web.get("/dashboard", dashboard_page),
            web.get("/dashboard/events", dashboard_events),
            web.get("/dashboard/dashboard.js", dashboard_asset),
            web.get("/dashboard/dashboard.css", dashboard_asset),
        ]
    )
    app.on_startup.append(_start_pool)
    app.on_cleanup.append(_close_pool)
    if tracer_provider is not None or config.otlp_traces_endpoint is not None:
        _add_tracing(app, config.otlp_traces_endpoint, tracer_provider)
    return app


def _add_tracing(app: web.Application, endpoint: str | None, provider: TracerProvider | None) -> None:
    from ember_core.tracing import otlp_exporter, tracer_provider
    from ember_gateway.tracing import add_tracing

    add_tracing(app, provider or tracer_provider("ember-gateway", otlp_exporter(endpoint)))


async def start_runner(app: web.Application, shutdown_timeout: float = 10.0) -> web.AppRunner:
    config = app[STATE].config
    runner = EdgeAppRunner(
        app,
        edge_limits=EdgeLimits(config.header_timeout, config.body_timeout, config.keepalive_timeout, config.max_connections),
        handler_cancellation=True,  # a client that goes away cancels its handler, which aborts its requests
        shutdown_timeout=shutdown_timeout,
        # the unread rest of a refused body is drained this long before the close, so that the
        # client reads the answer rather than a reset
        lingering_time=2.0,
        access_log=None,
    )
    await runner.setup()
    return runner


async def _start_pool(app: web.Application) -> None:
    await app[STATE].pool.start()


async def _close_pool(app: web.Application) -> None:
    await app[STATE].pool.close()


@web.middleware
async def _errors_middleware(request: web.Request, handler: web.Handler) -> web.StreamResponse:
    response = await _answer_or_error(request, handler)
    if response.status >= 400 and request.path != "/health":  # a probe's 503 is the gateway's state
        request.app[STATE].metrics.count_error(response.status)
    return response


async def _answer_or_error(request: web.Request, handler: web.Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http_exception(exc, request).response()
    except ConnectionResetError:
        raise  # the client is gone; nothing to answer
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return internal_error().response()


def _api_key_bytes(api_key: str | None) -> bytes | None:
    return api_key.encode() if api_key else None


def _api_key_error(request: web.Request, expected: bytes | None) -> ApiError | None:
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


def _auth_middleware(api_key: str | None) -> web.Middleware:
    expected = _api_key_bytes(api_key)

    @web.middleware
    async def check_api_key(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        error = _api_key_error(request, expected)
        if error is not None:
            raise error
        return await handler(request)

    return check_api_key


def _expect_handler(max_body_bytes: int, api_key: bytes | None) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """Answers `Expect: 100-continue` (curl sends it for bodies over 1 MB) before the client uploads:
    a request that would be refused anyway (no valid API key, a body refused by check_framing) gets
    its error instead of `100 Continue`, on a connection then closed, since its body never comes."""

    async def expect_continue(request: web.Request) -> web.StreamResponse | None:
        error = _api_key_error(request, api_key)
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


def _model_entry(model: ServedModel) -> Model:
    return Model(
        id=model.name,
        object="model",
        created=model.card.created,
        owned_by="ember",
        max_model_len=model.card.max_model_len,
        dtype=model.card.dtype or None,
        numerics=model.card.numerics or None,
    )


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[STATE].await_models()
    return json_response(ModelList(object="list", data=[_model_entry(model) for model in models]))


async def get_model(request: web.Request) -> web.Response:
    return json_response(_model_entry(await request.app[STATE].await_model(request.match_info["model"])))


async def health(request: web.Request) -> web.Response:
    """200 while at least one engine takes requests. model and engine_id: the first such engine's."""
    accepting = [client for client in request.app[STATE].pool.clients.values() if client.accepting and client.model]
    if not accepting:
        raise engine_unavailable()
    first = accepting[0].model
    return json_response(Health(
        status="ok",
        model=first.name,
        engine_id=first.engine_id,
        models=sorted({client.model.name for client in accepting}),
        engines=[client.address for client in accepting],
    ))


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
