"""The engines behind a gateway: one EngineClient each, found from fixed addresses or a DNS name
re-resolved every few seconds, and the router that picks one per request.

A request goes to an engine serving its model. The requests in flight on an engine that is lost,
draining or refusing new work move to another engine of the same model, which continues each from
the tokens it already sent; each such move counts as a migration. A lost engine's requests that no
engine takes wait `resume_wait_s` for a restarted engine at its address (Parking), or fail with a
503, so no handler waits forever; a draining engine's stay there to finish. An engine that comes
back, or joins, gets the LoRA adapters loaded while serving before it resumes (LoadedAdapters).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ember_core.cache.block_hash import prompt_block_hashes
from ember_core.config import EngineConfig
from ember_gateway.edge.errors import engine_unavailable
from ember_gateway.engines.client import EngineClient
from ember_gateway.engines.inflight import EngineFailure, InFlight, InFlightRequest, Output, fail
from ember_gateway.engines.loaded_adapters import LoadedAdapters
from ember_gateway.engines.parking import Parking
from ember_gateway.engines.router import Candidate, choose
from ember_gateway.engines.served_model import ServedModel
from ember_gateway.observability.trace_context import CURRENT_TRACE
from ember_proto import EngineStats, Generate, ModelCard

logger = logging.getLogger(__name__)

DNS_SCHEME = "dns+tcp://"
DNS_INTERVAL_S = 2.0
READY_POLL_S = 0.05
DEFAULT_STEP_TOKEN_BUDGET = EngineConfig.max_num_batched_tokens  # for an engine that does not report its own

Resolve = Callable[[str, int], Awaitable[list[str]]]  # (name, port) -> IP addresses


async def resolve_ips(name: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def tcp_address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


@dataclass(frozen=True)
class EngineSnapshot:
    address: str
    model_name: str
    stats: EngineStats
    card: ModelCard
    adapters: tuple[str, ...] = ()  # the LoRA adapters loaded there


class EnginePool:
    def __init__(
        self,
        addresses: list[str],
        *,
        watchdog_s: float,  # GatewayConfig.engine_timeout
        routing: str = "kv",
        model_name: str | None = None,
        resume_wait_s: float = 0.0,
        resolve: Resolve = resolve_ips,
    ) -> None:
        """addresses: tcp://HOST:PORT, ipc://PATH, or dns+tcp://NAME:PORT (every address NAME has)."""
        self._static = [address for address in addresses if not address.startswith(DNS_SCHEME)]
        self._names = [_name_and_port(address) for address in addresses if address.startswith(DNS_SCHEME)]
        self._routing = routing
        self._client_options = {"model_name": model_name, "watchdog_s": watchdog_s}
        self._resume_wait_s = resume_wait_s
        self._parking = Parking()
        self._resolve = resolve
        self.clients: dict[str, EngineClient] = {}
        self.routing_decisions: Counter[str] = Counter()
        self.migrations = 0
        self._turns = itertools.count()
        self._dns_task: asyncio.Task[None] | None = None
        self.loaded_adapters = LoadedAdapters()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for address in self._static:
            await self._add(address)
        if self._names:
            await self._refresh_dns()
            self._dns_task = asyncio.create_task(self._dns_loop(), name="dns")

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._dns_task] if self._dns_task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in self.clients.values()))
        self._parking.fail(None, "the gateway is shutting down")

    @property
    def ready(self) -> bool:
        """Whether at least one engine takes requests."""
        return any(client.accepting for client in self.clients.values())

    async def wait_ready(self, timeout: float) -> bool:
        """Whether an engine takes requests now or does within timeout seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.ready and loop.time() < deadline:
            await asyncio.sleep(READY_POLL_S)
        return self.ready

    def models(self) -> list[ServedModel]:
        """Each model an engine taking requests serves, once (the first such engine's card), and
        each LoRA adapter loaded over one."""
        served: dict[str, ServedModel] = {}
        for client in self.accepting():
            assert client.model is not None
            served.setdefault(client.model.name, client.model)
            for adapter in client.adapters.names:
                served.setdefault(adapter, client.model.with_adapter(adapter))
        return list(served.values())

    @property
    def num_in_flight(self) -> int:
        return sum(client.num_in_flight for client in self.clients.values()) + len(self._parking)

    def snapshots(self) -> list[EngineSnapshot]:
        return [
            EngineSnapshot(address, client.model.name, client.stats, client.model.card, tuple(client.adapters.names))
            for address, client in self.clients.items()
            if client.model is not None and client.stats is not None
        ]

    def submit(self, generates: list[Generate], model_name: str) -> asyncio.Queue[Output]:
        """Send one HTTP request's engine requests, all to the engine the router picks among those
        serving model_name; outputs arrive on the returned queue. ApiError 503 when none can."""
        candidates = [client for client in self.accepting() if model_name in (client.model.name, *client.adapters.names)]
        if not candidates:
            raise engine_unavailable()
        queue: asyncio.Queue[Output] = asyncio.Queue()
        self._route(candidates, generates, queue)
        return queue

    def release(self, request_ids: list[str]) -> None:
        """Stop routing these requests; the ones an engine has not finished are aborted there."""
        for client in self.clients.values():
            client.release(request_ids)
        self._parking.release(request_ids)

    def stop_resuming(self, reason: str) -> None:
        """No engine will resume requests from now on (the gateway is stopping): those waiting for
        one fail now, and later losses fail their requests at once."""
        self._resume_wait_s = 0.0
        self._parking.fail(None, f"the engine became unavailable ({reason})")

    def engine_ready(self, client: EngineClient) -> None:
        self._warn_of_settings_apart(client)
        if not self.loaded_adapters.missing_on(client):
            self._parking.resume(client)
            return
        task = asyncio.create_task(self._restore_adapters(client), name=f"adapters-{client.address}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restore_adapters(self, client: EngineClient) -> None:
        await self.loaded_adapters.restore(client)
        self._parking.resume(client)

    def _warn_of_settings_apart(self, client: EngineClient) -> None:
        """Engines serving one model id with other settings give other bits: routing among them is
        allowed, moving a request in flight between them is not (same_model)."""
        assert client.model is not None
        for other in self.accepting():
            if other is not client and other.model.name == client.model.name and (apart := client.model.settings_apart(other.model)):
                logger.warning(
                    "engines %s and %s serve %s with different settings (%s): the same request may get different "
                    "tokens from each, and requests in flight never move between them",
                    client.address, other.address, client.model.name, ", ".join(apart),
                )

    def engine_lost(self, client: EngineClient, reason: str, in_flight: InFlight) -> None:
        left = self._move(client, in_flight)
        if not left:
            return
        if self._resume_wait_s > 0 and client.model is not None:
            self._parking.park(client.address, client.model, left, self._resume_wait_s)
        else:
            fail(left, f"the engine became unavailable ({reason})")

    def engine_draining(self, client: EngineClient, in_flight: InFlight) -> None:
        left = self._move(client, in_flight)
        client.release([request_id for request_id in in_flight if request_id not in left])

    def request_refused(self, client: EngineClient, request: InFlightRequest, failure: EngineFailure) -> None:
        if self._move(client, {request.generate.request_id: request}):
            request.fail(failure)

    def accepting(self) -> list[EngineClient]:
        """The engines new requests may go to."""
        return [client for client in self.clients.values() if client.accepting and client.model is not None]

    def _route(self, candidates: list[EngineClient], generates: list[Generate], queue: asyncio.Queue[Output]) -> None:
        """Submit generates to the engine the router picks; with kv routing, the first prompt's
        blocks it computes count as that engine's from now on."""
        turn = next(self._turns)
        prompt_ids, adapter = generates[0].prompt_token_ids, generates[0].adapter
        kv = self._routing == "kv"
        hashes_by_cache: dict[tuple[int, str], list[bytes]] = {}

        def hashes(client: EngineClient) -> list[bytes]:
            """The prompt's block hashes as this engine computes them: by its block size and cache dtype."""
            cache = (client.model.block_size, client.model.card.kv_cache_dtype)
            if not (kv and cache[0]):
                return []
            if cache not in hashes_by_cache:
                hashes_by_cache[cache] = prompt_block_hashes(prompt_ids, *cache, adapter)
            return hashes_by_cache[cache]

        def prefill_tokens(client: EngineClient) -> int:
            """What generates compute there: the first prompt less its cached blocks, the other
            prompts in full (the n choices of one prompt share its blocks)."""
            cached = client.cached_blocks(hashes(client)) * client.model.block_size
            others = sum(len(g.prompt_token_ids) for g in generates[1:] if g.prompt_token_ids != prompt_ids)
            return len(prompt_ids) - cached + others

        uncached = [prefill_tokens(client) for client in candidates]
        scored = [
            Candidate(client.queued_prefill_tokens, client.num_waiting, client.num_running, tokens,
                      client.model.step_token_budget or DEFAULT_STEP_TOKEN_BUDGET, client.idle)
            for client, tokens in zip(candidates, uncached)
        ]
        index, reason = 0, "only"
        if len(candidates) > 1:
            decision = choose(scored, self._routing, turn)
            self.routing_decisions[decision.reason] += 1
            index, reason = decision.index, decision.reason
        if (trace := CURRENT_TRACE.get()) is not None:
            trace.routed(candidates[index].address, reason)
        candidates[index].submit(generates, queue, uncached[index], hashes(candidates[index]))

    def _move(self, source: EngineClient, in_flight: InFlight) -> InFlight:
        """Continue a lost, draining or refusing engine's requests on the least queued other engine
        of the same model; returns those none took."""
        if source.model is None or not in_flight:
            return in_flight
        targets = sorted(
            (c for c in self.accepting() if c is not source and c.model.same_model(source.model)),
            key=lambda client: (client.queued_prefill_tokens, client.num_running),
        )
        for target in targets:
            left = target.adopt(in_flight)
            moved = len(in_flight) - len(left)
            if moved:
                self.migrations += moved
                logger.warning("moved %d requests in flight from engine %s to %s", moved, source.address, target.address)
            in_flight = left
            if not in_flight:
                break
        return in_flight

    async def _add(self, address: str) -> None:
        client = EngineClient(address, self, **self._client_options)
        self.clients[address] = client
        await client.start()
        logger.info("engine %s joined", address)

    async def _remove(self, address: str) -> None:
        client = self.clients.pop(address)
        reason = "its address left DNS"
        message = f"the engine became unavailable ({reason})"
        self._parking.fail(address, message)
        fail(self._move(client, client.retire(reason)), message)
        await client.close()
        logger.info("engine %s left", address)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(DNS_INTERVAL_S)
            try:
                await self._refresh_dns()
            except Exception:
                logger.exception("engine discovery by DNS failed; keeping the engines known")

    async def _refresh_dns(self) -> None:
        wanted: set[str] = set(self._static)
        for name, port in self._names:
            try:
                wanted.update(tcp_address(ip, port) for ip in await self._resolve(name, port))
            except OSError as exc:  # a name with no address yet (no engine up), or a resolver hiccup
                logger.debug("cannot resolve %s: %s", name, exc)
                wanted.update(a for a in self.clients if a not in self._static)  # keep what we had
        for address in sorted(wanted - set(self.clients)):
            await self._add(address)
        for address in sorted(set(self.clients) - wanted):
            await self._remove(address)


def _name_and_port(address: str) -> tuple[str, int]:
    host, _, port = address[len(DNS_SCHEME):].rpartition(":")
    return host.strip("[]"), int(port)
