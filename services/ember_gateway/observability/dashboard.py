"""GET /dashboard: a live page of the engines' KV pools, queues and steps, and the gateway's rates;
its script and stylesheet ship in the package (static/), and GET /dashboard/events feeds it.

While a page is open its feed asks every engine for block maps (WatchBlocks), renewed on every
update; when the last page closes the engines stop building them within WATCH_S seconds."""

from __future__ import annotations

import asyncio
from importlib.resources import files

from aiohttp import web

from ember_gateway.edge.sse import open_stream, sse_event
from ember_gateway.observability.dashboard_feed import dashboard_update
from ember_gateway.state import STATE

UPDATE_INTERVAL_S = 0.5
WATCH_S = 5.0
ASSET_TYPES = {"dashboard.html": "text/html", "dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_ASSETS = {name: (files("ember_gateway.observability") / "static" / name).read_bytes() for name in ASSET_TYPES}


def _asset(name: str) -> web.Response:
    return web.Response(body=_ASSETS[name], content_type=ASSET_TYPES[name], charset="utf-8")


async def dashboard_page(request: web.Request) -> web.Response:
    return _asset("dashboard.html")


async def dashboard_asset(request: web.Request) -> web.Response:
    return _asset(request.path.rpartition("/")[2])


async def dashboard_events(request: web.Request) -> web.StreamResponse:
    """An update every UPDATE_INTERVAL_S until the client goes away (which cancels the handler)."""
    state = request.app[STATE]
    response = await open_stream(request)
    while True:
        for client in state.pool.clients.values():
            client.watch_blocks(WATCH_S)
        await response.write(sse_event(dashboard_update(state.pool, state.metrics)))
        await asyncio.sleep(UPDATE_INTERVAL_S)
