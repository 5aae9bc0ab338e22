"""What every handler of one app shares."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ember_gateway.config import GatewayConfig
from ember_gateway.edge.errors import ApiError, engine_unavailable
from ember_gateway.engines.pool import EnginePool
from ember_gateway.engines.served_model import ServedModel
from ember_gateway.observability.metrics import GatewayMetrics


@dataclass(frozen=True)
class GatewayState:
    config: GatewayConfig
    pool: EnginePool
    metrics: GatewayMetrics

    async def await_models(self) -> list[ServedModel]:
        """The models served, waiting up to config.engine_wait for an engine; ApiError 503 after."""
        if not self.pool.ready:
            await self.pool.wait_ready(self.config.engine_wait)
        models = self.pool.models()
        if not models:
            raise engine_unavailable()
        return models

    async def await_model(self, name: str) -> ServedModel:
        """The served model called name; ApiError 404 when no ready engine serves it."""
        for model in await self.await_models():
            if model.name == name:
                return model
        raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


STATE = web.AppKey("ember_gateway_state", GatewayState)
