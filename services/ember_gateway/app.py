"""The aiohttp application: routes, middlewares, and the engine pool's lifetime."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiohttp import web

from ember_gateway.api.adapters import load_lora_adapter, unload_lora_adapter
from ember_gateway.api.completions.chat import create_chat_completion
from ember_gateway.api.completions.completions import create_completion
from ember_gateway.api.embeddings import create_embeddings
from ember_gateway.api.models import get_model, list_models
from ember_gateway.api.openapi import openapi_document
from ember_gateway.api.responses.endpoint import create_response
from ember_gateway.api.tokenize import detokenize, tokenize
from ember_gateway.config import GatewayConfig
from ember_gateway.edge.auth import ApiKeys, auth_middleware
from ember_gateway.edge.connections import EdgeAppRunner, EdgeLimits
from ember_gateway.edge.cors import add_cors_headers, cors_middleware
from ember_gateway.edge.errors import ApiError, from_http_exception, internal_error
from ember_gateway.edge.expect_continue import expect_handler
from ember_gateway.engines.pool import EnginePool
from ember_gateway.observability.dashboard import dashboard_asset, dashboard_events, dashboard_page
from ember_gateway.observability.metrics import GatewayMetrics
from ember_gateway.observability.probes import health, metrics
from ember_gateway.state import STATE, GatewayState

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)


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
    keys = ApiKeys(*config.api_keys())
    app = web.Application(
        middlewares=[_errors_middleware, cors_middleware(config.allowed_origins), auth_middleware(keys)],
        client_max_size=config.max_body_bytes,
    )
    app.on_response_prepare.append(add_cors_headers(config.allowed_origins))
    app[STATE] = GatewayState(config, pool, GatewayMetrics(pool))
    expect = expect_handler(config.max_body_bytes, keys)
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
    if config.allow_runtime_lora_updating:  # else absent: 404 as any unknown route, and nothing reaches an engine
        app.add_routes([
            web.post("/v1/load_lora_adapter", load_lora_adapter, expect_handler=expect),
            web.post("/v1/unload_lora_adapter", unload_lora_adapter, expect_handler=expect),
        ])  # fmt: skip
    app.on_startup.append(_start_pool)
    app.on_cleanup.append(_close_pool)
    if tracer_provider is not None or config.otlp_traces_endpoint is not None:
        _add_tracing(app, config.otlp_traces_endpoint, tracer_provider)
    return app


def _add_tracing(app: web.Application, endpoint: str | None, provider: TracerProvider | None) -> None:
    from ember_core.tracing import otlp_exporter, tracer_provider
    from ember_gateway.observability.tracing import add_tracing

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


