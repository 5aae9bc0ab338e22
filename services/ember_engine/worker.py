"""The engine worker: a ROUTER socket in front of Engine.step().

Intake never blocks a step while work is running; when idle the loop blocks on the socket (up to
one heartbeat interval). After each step every gateway gets one StepOutputs with all its deltas.
A gateway that went away (killed, crashed) is noticed at the next message sent to it, and its
requests in flight are aborted: nobody would read their tokens. While a step runs, a thread keeps
heartbeating, so a step longer than a gateway's engine timeout (a long prompt's chunk on a slow
CPU) does not make the engine look dead; a lock serialises the two threads' use of the socket.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq

from ember_core.engine.block_map import block_holders
from ember_core.engine.engine import Engine
from ember_core.parallel.rank_lost import RankLost
from ember_core.sampling_params import SamplingParams
from ember_engine.adapter_loads import AdapterLoads
from ember_proto import (
    BLOCK_MAP_HZ,
    PROBE_ID_PREFIX,
    PROTOCOL_VERSION,
    AdapterDone,
    Adapters,
    BlockMap,
    EngineStats,
    GatewayMessage,
    Generate,
    Heartbeat,
    Hello,
    KvEvents,
    KvSync,
    LoadAdapter,
    ModelCard,
    Ready,
    RejectCode,
    Rejected,
    RequestDelta,
    StepOutputs,
    UnloadAdapter,
    WatchBlocks,
    decode_gateway_message,
    encode,
    make_socket,
)

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from ember_engine.tracing import EngineTracer

logger = logging.getLogger(__name__)

MAX_WATCH_S = 60.0  # a WatchBlocks asks for block maps this long at most


@dataclass
class WorkerOptions:
    bind: str
    heartbeat_interval: float = 1.0
    shutdown_timeout: float = 10.0  # seconds in-flight requests may still run after SIGTERM


@dataclass
class _Gateways:
    """Gateways that said Hello (socket identity -> when we last sent them anything) and which
    gateway owns each request in flight."""

    last_sent: dict[bytes, float] = field(default_factory=dict)
    owner_of: dict[str, bytes] = field(default_factory=dict)


class EngineWorker:
    def __init__(self, engine: Engine, model_id: str, options: WorkerOptions, tracer: EngineTracer | None = None) -> None:
        self.engine = engine
        self.options = options
        self.engine_id = uuid.uuid4().hex
        self.tracer = tracer
        if tracer is not None:
            engine.schedule_observer = tracer.scheduled
        self.context = zmq.Context()
        self.socket = make_socket(self.context, zmq.ROUTER, options.bind, bind=True)
        # Sending to a disconnected gateway raises EHOSTUNREACH instead of dropping the message.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.gateways = _Gateways()
        self.lost_gateways: set[bytes] = set()
        self.socket_lock = threading.Lock()
        self.stepping = False
        self.stopped = threading.Event()
        self.deadlines: list[tuple[float, str]] = []
        self.step_counter = 0
        self.expert_load_sent: dict[bytes, float] = {}  # gateway -> when its stats last carried the experts' load
        self.draining_since: float | None = None
        self.drain_announced = False
        # Gateways with a dashboard open -> until when they asked for block maps (monotonic)
        self.block_watchers: dict[bytes, float] = {}
        self.block_map_sent = 0.0
        self.adapter_loads = AdapterLoads(engine)
        # KV events: the prefix cache's changes, batched per step, for the gateways' routing
        self.kv_events = engine.scheduler.prefix_caching  # off for a hybrid model (no state checkpoints yet)
        self.kv_sequence = 0
        if self.kv_events:
            engine.block_manager.take_events()  # starts recording
        tokenizer = engine.tokenizer
        matryoshka = engine.loaded.pooling.matryoshka_dimensions
        self.ready = Ready(
            PROTOCOL_VERSION,
            self.engine_id,
            ModelCard(
                model_id=model_id,
                max_model_len=engine.max_model_len,
                vocab_size=engine.loaded.vocab_size,
                stop_token_ids=sorted(engine.stop_token_ids),
                tokenizer_spec=msgspec.msgpack.encode(tokenizer.spec) if tokenizer is not None else b"",
                created=int(time.time()),
                hidden_size=engine.hidden_size,
                matryoshka_dimensions=None if matryoshka is None else list(matryoshka),
                dtype=str(engine.loaded.dtype).removeprefix("torch."),
                numerics=engine.loaded.numerics,
                kv_cache_dtype=engine.kv_cache_dtype,
                kv_cache_bytes=engine.kv_cache_bytes,
                cpu_build=engine.loaded.cpu_build,
                state_pool_bytes=engine.state_pool_bytes,
            ),
            block_size=engine.block_manager.block_size if self.kv_events else 0,
            step_token_budget=engine.scheduler.max_num_batched_tokens,
            task=engine.config.task,
            max_loras=engine.config.max_loras if engine.config.enable_lora else 0,
        )

    def request_shutdown(self) -> None:
        if self.draining_since is None:
            logger.info("shutdown requested: no new requests; %d in flight", len(self.gateways.owner_of))
            self.draining_since = time.monotonic()

    def run(self) -> None:
        logger.info("engine %s listening on %s", self.engine_id, self.options.bind)
        beats = threading.Thread(target=self._heartbeat_during_steps, name="heartbeats", daemon=True)
        beats.start()
        try:
            while not (self.draining_since is not None and not self.engine.has_unfinished()):
                busy = self.engine.has_unfinished()
                self._receive(timeout_ms=0 if busy else int(self.options.heartbeat_interval * 1000))
                self.engine.check_ranks()  # a lost tensor-parallel rank ends the engine (RankLost)
                self._expire_deadlines()
                self._abort_all_after_shutdown_timeout()
                if self.engine.has_unfinished():
                    self._step()
                self._answer_adapter_change(self.adapter_loads.finished())
                self._announce_drain()
                self._heartbeat()
                self._send_block_maps()
                self._drop_lost_gateways()
        finally:
            self.stopped.set()
            beats.join()
            self.socket.close()
            self.context.term()
            if self.tracer is not None:
                self.tracer.shutdown()
        logger.info("engine stopped")

    def _heartbeat_during_steps(self) -> None:
        while not self.stopped.wait(self.options.heartbeat_interval / 2):
            if self.stepping:
                self._heartbeat()

    def _receive(self, timeout_ms: int) -> None:
        with self.socket_lock:
            if not self.socket.poll(timeout_ms):
                return
        while True:
            try:
                with self.socket_lock:
                    frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                logger.warning("dropping a message of %d frames (expected identity + payload)", len(frames))
                continue
            identity, payload = frames
            try:
                message = decode_gateway_message(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropping a malformed message from %r: %s", identity, exc)
                continue
            self._handle(identity, message)

    def _handle(self, identity: bytes, message: GatewayMessage) -> None:
        if isinstance(message, Hello):
            if self.draining_since is not None:
                self._send(identity, Rejected("", RejectCode.UNAVAILABLE, "the engine is shutting down"))
                return
            if message.protocol_version != PROTOCOL_VERSION:
                self._send(identity, Rejected("", RejectCode.INVALID_REQUEST,
                                              f"protocol version {message.protocol_version} is not {PROTOCOL_VERSION}"))
                return
            if identity not in self.gateways.last_sent:  # a gateway may repeat its Hello (see ember_gateway.engines.client)
                probe = message.gateway_id.startswith(PROBE_ID_PREFIX)  # every few seconds, for ever
                logger.log(logging.DEBUG if probe else logging.INFO, "gateway %s connected", message.gateway_id)
            self.gateways.last_sent[identity] = 0.0
            self._send(identity, msgspec.structs.replace(self.ready, adapters=self.adapter_loads.names))
            self._send_kv_snapshot(identity)
        elif isinstance(message, Generate):
            self._generate(identity, message)
        elif isinstance(message, KvSync):
            self._send_kv_snapshot(identity)
        elif isinstance(message, WatchBlocks):
            if identity in self.gateways.last_sent:
                self.block_watchers[identity] = time.monotonic() + min(max(message.seconds, 0.0), MAX_WATCH_S)
        elif isinstance(message, LoadAdapter):
            answer = self.adapter_loads.load(identity, message)
            if answer is not None:
                self._send(identity, answer)
        elif isinstance(message, UnloadAdapter):
            self._answer_adapter_change([(identity, self.adapter_loads.unload(message))])
        else:
            owned = [r for r in message.request_ids if self.gateways.owner_of.get(r) == identity]
            self.engine.abort(owned)

    def _generate(self, identity: bytes, message: Generate) -> None:
        request_id = message.request_id
        if self.draining_since is not None:
            self._send(identity, Rejected(request_id, RejectCode.UNAVAILABLE, "the engine is shutting down"))
            return
        if identity not in self.gateways.last_sent:
            self._send(identity, Rejected(request_id, RejectCode.UNAVAILABLE, "unknown gateway: send Hello first"))
            return
        try:
            params = SamplingParams.from_wire(message.sampling)
            self.engine.add_request(
                request_id, message.prompt_token_ids, params, time.monotonic(), message.output_token_ids, message.embed,
                message.adapter,
            )
        except (ValueError, TypeError) as exc:  # RequestRejected is a ValueError
            self._send(identity, Rejected(request_id, RejectCode.INVALID_REQUEST, str(exc)))
            return
        if self.tracer is not None:
            self.tracer.started(message)
        self.gateways.owner_of[request_id] = identity
        if message.deadline is not None:
            heapq.heappush(self.deadlines, (message.deadline, request_id))

    def _answer_adapter_change(self, answers: list[tuple[bytes, AdapterDone]]) -> None:
        """Each load or unload's answer to its gateway, then the adapters to every gateway if any changed."""
        for identity, answer in answers:
            self._send(identity, answer)
        if any(answer.code == 200 for _, answer in answers):
            adapters = Adapters(self.engine_id, self.adapter_loads.names)
            for identity in list(self.gateways.last_sent):
                self._send(identity, adapters)

    def _expire_deadlines(self) -> None:
        now = time.time()
        expired = []
        while self.deadlines and self.deadlines[0][0] <= now:
            expired.append(heapq.heappop(self.deadlines)[1])
        if expired:
            self.engine.abort([r for r in expired if r in self.gateways.owner_of])

    def _abort_all_after_shutdown_timeout(self) -> None:
        if self.draining_since is not None and time.monotonic() - self.draining_since > self.options.shutdown_timeout:
            self.engine.abort(list(self.gateways.owner_of))

    def _step(self) -> None:
        self.stepping = True
        try:
            deltas = self.engine.step()
        except RankLost:
            raise  # the model is gone with its rank: the process exits, and the gateways move its requests
        except Exception:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all("the engine failed while running this request")
            return
        finally:
            self.stepping = False
        self.step_counter += 1
        if self.tracer is not None:
            self.tracer.step_ended(deltas)
        by_gateway: dict[bytes, list[RequestDelta]] = {}
        for delta in deltas:
            owner = self.gateways.owner_of.get(delta.request_id)
            if owner is None:
                continue
            if delta.finish_reason is not None:
                del self.gateways.owner_of[delta.request_id]
            by_gateway.setdefault(owner, []).append(delta)
        stats = self.engine.stats()
        for identity, outputs in by_gateway.items():
            self._send(identity, StepOutputs(self.step_counter, outputs, self._with_expert_load(identity, stats)))
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if not self.kv_events:
            return
        events = self.engine.block_manager.take_events()
        if not (events.stored or events.removed):
            return
        self.kv_sequence += 1
        batch = KvEvents(self.engine_id, self.kv_sequence, events.stored, events.removed)
        for identity in list(self.gateways.last_sent):
            self._send(identity, batch)

    def _send_kv_snapshot(self, identity: bytes) -> None:
        if self.kv_events:
            hashes = self.engine.block_manager.cached_hashes()
            self._send(identity, KvEvents(self.engine_id, self.kv_sequence, hashes, snapshot=True))

    def _fail_all(self, message: str) -> None:
        in_flight = dict(self.gateways.owner_of)
        self.engine.abort(list(in_flight))
        deltas = self.engine.step()  # only collects the abort deltas: nothing is left to compute
        if self.tracer is not None:
            self.tracer.step_ended(deltas)
        self.gateways.owner_of.clear()
        for request_id, identity in in_flight.items():
            self._send(identity, Rejected(request_id, RejectCode.INTERNAL, message))

    def _with_expert_load(self, identity: bytes, stats: EngineStats) -> EngineStats:
        """stats, carrying a mixture of experts' load when this gateway last got it a heartbeat
        interval ago or more (it can be thousands of numbers: not every step)."""
        now = time.monotonic()
        if now - self.expert_load_sent.get(identity, 0.0) < self.options.heartbeat_interval:
            return stats
        self.expert_load_sent[identity] = now
        load = self.engine.expert_load()
        return msgspec.structs.replace(stats, expert_tokens=load) if load else stats

    def _heartbeat(self) -> None:
        now = time.monotonic()
        # A copy: the other thread may add or drop gateways meanwhile.
        due = [g for g, sent in list(self.gateways.last_sent.items()) if now - sent >= self.options.heartbeat_interval]
        if due:
            stats = self.engine.stats()
            for identity in due:
                draining = self.draining_since is not None
                self._send(identity, Heartbeat(self.engine_id, self._with_expert_load(identity, stats), draining=draining))

    def _send_block_maps(self) -> None:
        """The pool's block map to the gateways watching it, BLOCK_MAP_HZ times a second at most;
        nothing is built while none watches."""
        now = time.monotonic()
        if not self.block_watchers or now - self.block_map_sent < 1 / BLOCK_MAP_HZ:
            return
        self.block_watchers = {g: until for g, until in self.block_watchers.items() if until > now}
        if not self.block_watchers:
            return
        self.block_map_sent = now
        holders, running = block_holders(self.engine.block_manager, self.engine.scheduler.running.values())
        waiting = [seq.request_id for seq in self.engine.scheduler.waiting]
        steps = list(self.engine.step_samples)
        self.engine.step_samples.clear()
        block_map = BlockMap(self.engine_id, holders, running, waiting, steps)
        for identity in list(self.block_watchers):
            self._send(identity, block_map, defers_heartbeat=False)

    def _announce_drain(self) -> None:
        """Tells every gateway at once that no new request may come here, so they route elsewhere
        (and move the requests in flight to another engine where there is one)."""
        if self.draining_since is not None and not self.drain_announced:
            self.drain_announced = True
            heartbeat = Heartbeat(self.engine_id, self.engine.stats(), draining=True)
            for identity in list(self.gateways.last_sent):
                self._send(identity, heartbeat)

    def _drop_lost_gateways(self) -> None:
        with self.socket_lock:
            lost, self.lost_gateways = self.lost_gateways, set()
        for identity in lost:
            self.gateways.last_sent.pop(identity, None)
            self.expert_load_sent.pop(identity, None)
            self.block_watchers.pop(identity, None)
            orphans = [r for r, owner in self.gateways.owner_of.items() if owner == identity]
            for request_id in orphans:
                del self.gateways.owner_of[request_id]
            self.engine.abort(orphans)
            name = identity.decode(errors="replace")
            if orphans:
                logger.warning("gateway %s went away; aborted its %d requests in flight", name, len(orphans))
            else:  # a health probe done, a gateway scaled away: nothing lost
                logger.debug("gateway %s went away with no request in flight", name)

    def _send(self, identity: bytes, message, defers_heartbeat: bool = True) -> None:
        """defers_heartbeat: False for BlockMaps, sent so often that they would hold back the
        heartbeats, and with them the stats, of an idle engine."""
        if defers_heartbeat and identity in self.gateways.last_sent:
            self.gateways.last_sent[identity] = time.monotonic()
        with self.socket_lock:
            try:
                self.socket.send_multipart([identity, encode(message)], zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("gateway %r is not reading; dropped a %s", identity, type(message).__name__)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self.lost_gateways.add(identity)
