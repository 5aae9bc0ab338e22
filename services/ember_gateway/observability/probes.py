"""What probes and scrapers ask: GET /health (ready while any engine takes requests) and GET /metrics."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember_gateway.api.completions.respond import json_response
from ember_gateway.api.response_bodies import Health
from ember_gateway.edge.errors import engine_unavailable
from ember_gateway.state import STATE


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
