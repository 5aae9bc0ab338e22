"""The LoRA adapters this gateway loaded while serving (POST /v1/load_lora_adapter), by name and
path. An engine keeps only its --lora-modules when it restarts, and one that joins later has none of
them: each is loaded there again before the engine resumes parked requests, and routing sends an
adapter's requests only to engines that list it."""

from __future__ import annotations

import logging
import uuid

from ember_gateway.engines.client import EngineClient
from ember_proto import AdapterDone, LoadAdapter, UnloadAdapter

logger = logging.getLogger(__name__)

# A load reads the checkpoint on each engine's host, or downloads it from the Hub first.
ADAPTER_TIMEOUT_S = 300.0


def adapter_message(kind: type[LoadAdapter | UnloadAdapter], *args: str) -> LoadAdapter | UnloadAdapter:
    return kind(f"adapter-{uuid.uuid4().hex}", *args)


class LoadedAdapters:
    def __init__(self) -> None:
        self.paths: dict[str, str] = {}

    def missing_on(self, client: EngineClient) -> list[str]:
        return [name for name in self.paths if name not in client.adapters.names]

    async def restore(self, client: EngineClient) -> None:
        """Load on client every adapter it lacks; a refusal is logged (that adapter's requests go
        to the engines that have it)."""
        for name in self.missing_on(client):
            answer: AdapterDone = await client.change_adapter(adapter_message(LoadAdapter, name, self.paths[name]), ADAPTER_TIMEOUT_S)
            if answer.code == 200:
                logger.info("loaded LoRA adapter %s again on engine %s", name, client.address)
            else:
                logger.warning("engine %s could not load LoRA adapter %s again: %s", client.address, name, answer.message)
