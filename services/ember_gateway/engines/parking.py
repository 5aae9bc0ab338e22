"""Requests in flight on a lost engine that no other engine took, waiting up to
`--engine-resume-wait` for a restarted engine at the same address to continue them."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ember_gateway.engines.client import EngineClient
from ember_gateway.engines.inflight import InFlight, fail
from ember_gateway.engines.served_model import ServedModel

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Lot:
    lost: ServedModel  # what the lost engine served, under its engine id
    requests: InFlight
    expiry: asyncio.TimerHandle


class Parking:
    def __init__(self) -> None:
        self._lots: dict[str, _Lot] = {}  # by engine address

    def __len__(self) -> int:
        return sum(len(lot.requests) for lot in self._lots.values())

    def park(self, address: str, lost: ServedModel, requests: InFlight, wait_s: float) -> None:
        lot = self._lots.get(address)
        if lot is None:
            message = f"the engine became unavailable (none came back within {wait_s:g} s)"
            expiry = asyncio.get_running_loop().call_later(wait_s, self.fail, address, message)
            lot = self._lots[address] = _Lot(lost, {}, expiry)
        lot.requests.update(requests)
        logger.warning("%d requests in flight wait up to %g s for an engine to resume them", len(lot.requests), wait_s)

    def resume(self, client: EngineClient) -> None:
        """Continue the requests parked at client's address on its engine, ready again, if it is a
        restarted one serving the same model. One that answers again under its old id may still hold
        them (a stall, not a restart): they fail."""
        lot = self._take(client.address)
        if lot is None:
            return
        new = client.model
        assert new is not None
        if new.engine_id == lot.lost.engine_id:
            fail(lot.requests, "the engine became unavailable (it stopped answering)")
            return
        if not lot.lost.same_model(new):
            fail(lot.requests, "the engine became unavailable (it restarted with another model or other settings)")
            return
        refused = client.adopt(lot.requests)
        resumed = len(lot.requests) - len(refused)
        fail(refused, "the engine is not accepting requests right now")
        logger.info("resumed %d requests in flight on engine %s", resumed, new.engine_id)

    def release(self, request_ids: list[str]) -> None:
        """Stop waiting for these requests (their clients went away)."""
        for address in list(self._lots):
            requests = self._lots[address].requests
            for request_id in request_ids:
                requests.pop(request_id, None)
            if not requests:
                self._take(address)

    def fail(self, address: str | None, message: str) -> None:
        """Fail the requests parked at address, or at every address if None."""
        for each in list(self._lots) if address is None else [address]:
            lot = self._take(each)
            if lot is not None:
                fail(lot.requests, message)

    def _take(self, address: str) -> _Lot | None:
        lot = self._lots.pop(address, None)
        if lot is not None:
            lot.expiry.cancel()
        return lot
