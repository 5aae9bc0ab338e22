"""What every handler of one app shares."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ember_gateway.config import GatewayConfig
from ember_gateway.engine_client import EngineClient, ServedModel
from ember_gateway.errors import engine_unavailable
from ember_gateway.metrics import GatewayMetrics


@dataclass(frozen=True)
class GatewayState:
    config: GatewayConfig
    client: EngineClient
    metrics: GatewayMetrics

    async def await_model(self) -> ServedModel:
        """The model being served, waiting up to config.engine_wait for an engine; ApiError 503 after."""
        if not self.client.ready:
            await self.client.wait_ready(self.config.engine_wait)
        return self.require_model()

    def require_model(self) -> ServedModel:
        """The model being served; ApiError 503 while no engine is ready."""
        model = self.client.model
        if not self.client.ready or model is None:
            raise engine_unavailable()
        return model


STATE = web.AppKey("ember_gateway_state", GatewayState)
