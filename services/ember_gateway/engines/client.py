"""The gateway's view of one engine: the model it serves (card and tokenizer), its load, what its
prefix cache holds, whether it takes requests, and the requests in flight on it.

It reads the engine's messages off an EngineLink. Whatever makes the engine unusable (disconnect,
silence, a new engine id, a drain, a refusal) it reports to its EngineEvents, the pool, with the
requests in flight there; the pool decides where they go.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

import msgspec

from ember_gateway.edge.errors import engine_unavailable
from ember_gateway.engines.adapters import EngineAdapters
from ember_gateway.engines.inflight import EngineFailure, InFlight, InFlightRequest, Output, deliver, fail
from ember_gateway.engines.kv_index import KvIndex
from ember_gateway.engines.link import EngineLink
from ember_gateway.engines.served_model import ServedModel, TokenizerCache
from ember_proto import (
    BLOCK_MAP_STEPS,
    PROTOCOL_VERSION,
    Abort,
    AdapterDone,
    Adapters,
    BlockMap,
    EngineMessage,
    EngineStats,
    Generate,
    Heartbeat,
    KvEvents,
    KvSync,
    LoadAdapter,
    Ready,
    Rejected,
    StepOutputs,
    StepSample,
    UnloadAdapter,
    WatchBlocks,
)

logger = logging.getLogger(__name__)


class EngineEvents(Protocol):
    """What a client tells its pool, which decides where displaced requests go."""

    def engine_ready(self, client: EngineClient) -> None: ...

    def engine_lost(self, client: EngineClient, reason: str, in_flight: InFlight) -> None:
        """in_flight ran on the lost engine and no longer runs anywhere."""
        ...

    def engine_draining(self, client: EngineClient, in_flight: InFlight) -> None:
        """in_flight still runs on the draining engine; what moves must be released from it."""
        ...

    def request_refused(self, client: EngineClient, request: InFlightRequest, failure: EngineFailure) -> None:
        """The engine refused the request (503) and no longer runs it."""
        ...


class EngineClient:
    def __init__(self, address: str, events: EngineEvents, *, model_name: str | None = None, watchdog_s: float) -> None:
        self.address = address
        self.model: ServedModel | None = None
        self.stats: EngineStats | None = None
        self.kv_index = KvIndex()
        # For the dashboard, while one watches: the engine's latest BlockMap and its last steps
        self.block_map: BlockMap | None = None
        self.recent_steps: deque[StepSample] = deque(maxlen=BLOCK_MAP_STEPS)
        self.draining = False
        self.adapters = EngineAdapters(address)
        self.sent_since_stats = 0  # requests sent after the engine's latest stats
        self.tokens_sent_since_stats = 0  # the prompt tokens they will compute there
        self._events = events
        self._link = EngineLink(address, self, watchdog_s=watchdog_s)
        self._ready = False
        self._model_name = model_name
        self._in_flight: InFlight = {}
        self._connection_epoch = 0  # bumped whenever the engine is lost; stale Ready handling checks it
        self._last_rejection = ""
        self._tokenizers = TokenizerCache()

    @property
    def ready(self) -> bool:
        """Whether an engine is connected and serving this gateway's model."""
        return self._ready

    @property
    def accepting(self) -> bool:
        """Whether new requests may go to this engine: ready and not draining."""
        return self.ready and not self.draining

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens queued to compute: as the engine last reported, plus what this gateway sent since."""
        reported = 0 if self.stats is None else self.stats.num_queued_prefill_tokens
        return reported + self.tokens_sent_since_stats

    @property
    def num_waiting(self) -> int:
        """Requests queued: as the engine last reported, plus what this gateway sent since."""
        return (0 if self.stats is None else self.stats.num_waiting) + self.sent_since_stats

    @property
    def num_running(self) -> int:
        return 0 if self.stats is None else self.stats.num_running

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or sent since the engine's last report."""
        stats = self.stats
        return not self.sent_since_stats and (stats is None or stats.num_running + stats.num_waiting == 0)

    def cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt the engine holds, or computes for a request in flight."""
        return self.kv_index.cached_prefix(block_hashes, self._in_flight)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def start(self) -> None:
        await self._link.start()

    def watch_blocks(self, seconds: float) -> None:
        """Ask the engine for its block map for that long (a dashboard is open)."""
        if self.ready:
            self._link.send(WatchBlocks(seconds))

    async def close(self) -> None:
        await self._link.close()
        fail(self._in_flight, "the gateway is shutting down")

    def retire(self, reason: str) -> InFlight:
        """This engine leaves the pool: it is lost, and its requests in flight are returned."""
        return self._lose(reason)

    def submit(
        self, generates: list[Generate], queue: asyncio.Queue[Output], prefill_tokens: int, prompt_hashes: list[bytes]
    ) -> None:
        """Send the engine requests; their outputs arrive on queue, tagged with their index in
        generates. prefill_tokens: the prompt tokens they will compute there; prompt_hashes: the
        first prompt's block hashes, which count as the engine's while it runs. Raises ApiError 503
        when the engine cannot take them."""
        if not self.accepting:
            raise engine_unavailable()
        for index, generate in enumerate(generates):
            if not self._link.send(generate):
                self.release([g.request_id for g in generates[:index]])
                raise engine_unavailable("the engine is not accepting requests right now")
            self._in_flight[generate.request_id] = InFlightRequest(queue, index, generate)
        self.sent_since_stats += len(generates)
        self.tokens_sent_since_stats += prefill_tokens
        if prompt_hashes:
            self.kv_index.expect(generates[0].request_id, prompt_hashes, self._in_flight)

    def adopt(self, in_flight: InFlight) -> InFlight:
        """Continue another engine's requests here, each after the tokens it already sent; returns
        those this engine could not take."""
        if not self.accepting:
            return in_flight
        refused: InFlight = {}
        for request_id, request in in_flight.items():
            resumed = request.resumed()
            if self._link.send(resumed):
                self._in_flight[request_id] = request
                self.sent_since_stats += 1
                self.tokens_sent_since_stats += len(resumed.prompt_token_ids) + len(resumed.output_token_ids)
            else:
                refused[request_id] = request
        return refused

    def release(self, request_ids: list[str]) -> None:
        """Stop routing these requests; the ones the engine has not finished are aborted."""
        unfinished = [request_id for request_id in request_ids if self._in_flight.pop(request_id, None) is not None]
        if unfinished:
            self._link.send(Abort(unfinished))

    async def on_message(self, message: EngineMessage, previous_message_at: float) -> None:
        if isinstance(message, StepOutputs):
            self._set_stats(message.stats)
            deliver(self._in_flight, message, previous_message_at)
        elif isinstance(message, Heartbeat):
            self._on_heartbeat(message)
        elif isinstance(message, Ready):
            await self._on_ready(message)
        elif isinstance(message, KvEvents):
            self._on_kv_events(message)
        elif isinstance(message, BlockMap):
            self._on_block_map(message)
        elif isinstance(message, Adapters | AdapterDone):
            self.adapters.on_message(message, None if self.model is None else self.model.engine_id)
        else:
            self._on_rejected(message)

    async def change_adapter(self, message: LoadAdapter | UnloadAdapter, timeout_s: float) -> AdapterDone:
        return await self.adapters.change(lambda m: self.accepting and self._link.send(m), message, timeout_s)

    def on_lost(self, reason: str) -> None:
        self._events.engine_lost(self, reason, self._lose(reason))

    def _on_heartbeat(self, message: Heartbeat) -> None:
        self._set_stats(message.stats)
        if self.model is not None and message.engine_id != self.model.engine_id:
            self.on_lost("the engine restarted")
        elif message.draining and not self.draining:
            self.draining = True
            logger.warning("engine %s (%s) is draining: no new requests go to it", self.address, message.engine_id)
            self._events.engine_draining(self, dict(self._in_flight))

    def _on_kv_events(self, message: KvEvents) -> None:
        if self.model is not None and message.engine_id == self.model.engine_id and self.kv_index.apply(message):
            logger.info("missed KV events of engine %s; asking for a snapshot", self.address)
            self._link.send(KvSync())

    def _on_block_map(self, message: BlockMap) -> None:
        if self.model is not None and message.engine_id == self.model.engine_id:
            self.block_map = message
            self.recent_steps.extend(message.steps)

    def _set_stats(self, stats: EngineStats) -> None:
        if not stats.expert_tokens and self.stats is not None:  # sent once a second: keep the last
            stats = msgspec.structs.replace(stats, expert_tokens=self.stats.expert_tokens)
        self.stats = stats
        self.sent_since_stats = 0
        self.tokens_sent_since_stats = 0

    async def _on_ready(self, message: Ready) -> None:
        if message.protocol_version != PROTOCOL_VERSION:
            self._log_rejection(f"engine speaks protocol {message.protocol_version}, this gateway {PROTOCOL_VERSION}")
            return
        if self.model is not None and message.engine_id != self.model.engine_id:
            self.on_lost("the engine restarted")
        elif self.ready:
            return  # an answer to an extra Hello
        epoch = self._connection_epoch
        tokenizer = await self._tokenizers.get(message.model.tokenizer_spec)
        if epoch != self._connection_epoch:
            return  # lost again while the tokenizer was built; the next Hello brings a fresh Ready
        name = self._model_name or message.model.model_id
        self.adapters.names = list(message.adapters)
        self.model = ServedModel(
            name=name, engine_id=message.engine_id, card=message.model, tokenizer=tokenizer,
            block_size=message.block_size, step_token_budget=message.step_token_budget, task=message.task,
        )
        self.draining = False
        self._ready = True
        self._last_rejection = ""
        self._events.engine_ready(self)
        logger.info(
            "engine %s ready: model %s (served as %s), max_model_len %d, %s",
            message.engine_id, message.model.model_id, self.model.name, message.model.max_model_len,
            "with a tokenizer" if tokenizer is not None else "token ids only (no tokenizer)",
        )

    def _on_rejected(self, message: Rejected) -> None:
        code = int(message.code)
        if not message.request_id:
            self._log_rejection(f"the engine rejected this gateway ({code}): {message.message}")
            self.on_lost(message.message)
            return
        request = self._in_flight.pop(message.request_id, None)
        if code == 503:
            # Draining, or restarted and no longer knows this gateway: stop sending until Ready.
            self._ready = False
        if request is None:
            return
        failure = EngineFailure(code if code in (400, 503) else 500, message.message)
        if code == 503:
            self._events.request_refused(self, request, failure)
        else:
            request.fail(failure)

    def _lose(self, reason: str) -> InFlight:
        """Mark the engine lost; returns the requests that were in flight on it, aborted there."""
        if self.ready:
            logger.warning("engine unavailable: %s", reason)
        self._ready = False
        self._connection_epoch += 1
        self.stats = None  # the lost engine's gauges are unknown now, not its last values
        self.kv_index.clear()
        self.block_map = None
        self.recent_steps.clear()
        in_flight, self._in_flight = self._in_flight, {}
        if in_flight:
            # The engine may still be alive (only silent): stop it spending work on these.
            self._link.send(Abort(list(in_flight)))
        return in_flight

    def _log_rejection(self, message: str) -> None:
        if message != self._last_rejection:
            logger.error("%s; staying not ready", message)
            self._last_rejection = message
