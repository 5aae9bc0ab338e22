"""The zmq link to one engine and its liveness: a DEALER that says Hello until the engine answers,
and reports the engine lost on a disconnect or a silence past the watchdog."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ember_proto import (
    PROTOCOL_VERSION,
    Abort,
    EngineMessage,
    Generate,
    Hello,
    KvSync,
    WatchBlocks,
    decode_engine_message,
    encode,
    make_socket,
)

logger = logging.getLogger(__name__)

HELLO_INTERVAL_S = 0.5
# A Hello the engine has not answered is re-sent this rarely, so a stalled engine does not find
# a pile of Hellos (each answered with the whole tokenizer) when it resumes.
UNANSWERED_HELLO_RETRY_S = 5.0


class LinkListener(Protocol):
    @property
    def ready(self) -> bool:
        """Whether the engine answered Hello: the watchdog runs, and no more Hellos go out."""
        ...

    async def on_message(self, message: EngineMessage, previous_message_at: float) -> None:
        """previous_message_at: time.monotonic() when the link received the engine's previous message."""
        ...

    def on_lost(self, reason: str) -> None: ...


class EngineLink:
    def __init__(self, address: str, listener: LinkListener, *, watchdog_s: float) -> None:
        self.address = address
        self.gateway_id = f"gw-{uuid.uuid4().hex}"
        self._listener = listener
        self._watchdog_s = watchdog_s
        self._connected = False
        self._last_message_at = time.monotonic()
        self._last_hello_at = 0.0
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = make_socket(
            self._context, zmq.DEALER, self.address, bind=False, identity=self.gateway_id.encode()
        )
        monitor_address = f"inproc://ember-gateway-monitor-{self.gateway_id}"
        self._socket.monitor(monitor_address, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._monitor = make_socket(self._context, zmq.PAIR, monitor_address, bind=False)
        # The handshake may finish before the monitor is attached and go unreported: this Hello,
        # queued until the connection is up, gets an answer either way.
        self._send_hello()
        self._tasks = [
            asyncio.create_task(_forever(loop), name=loop.__name__)
            for loop in (self._receive_loop, self._monitor_loop, self._tick_loop)
        ]

    async def close(self) -> None:
        """Nothing is reported to the listener after this returns."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.disable_monitor()
        for socket in (self._monitor, self._socket):
            if socket is not None:
                socket.close()
        if self._context is not None:
            self._context.term()

    def send(self, message: Hello | Generate | Abort | KvSync | WatchBlocks) -> bool:
        """Send without waiting (so an Abort leaves in the caller's event-loop turn); False if zmq
        could not queue it."""
        assert self._socket is not None
        # Never awaited: with DONTWAIT and no send ever left pending, the future is already done.
        sent = self._socket.send(encode(message), zmq.DONTWAIT)
        if sent.done() and sent.exception() is not None:
            logger.warning("could not send %s to the engine: %s", type(message).__name__, sent.exception())
            return False
        return True

    def _send_hello(self) -> None:
        self._last_hello_at = time.monotonic()
        self.send(Hello(PROTOCOL_VERSION, self.gateway_id))

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            try:
                message = decode_engine_message(frames[-1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropping a malformed message from the engine: %s", exc)
                continue
            previous_message_at, self._last_message_at = self._last_message_at, time.monotonic()
            # Also covers a handshake that finished before the monitor was attached.
            self._connected = True
            try:
                await self._listener.on_message(message, previous_message_at)
            except Exception:
                logger.exception("failed to handle a %s from the engine", type(message).__name__)

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
                self._send_hello()
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._listener.on_lost("lost the connection to the engine")

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(HELLO_INTERVAL_S)
            now = time.monotonic()
            if self._listener.ready and now - self._last_message_at > self._watchdog_s:
                self._listener.on_lost(f"no message from the engine for {self._watchdog_s:g} s")
            if not self._listener.ready and self._connected:
                unanswered = self._last_hello_at > self._last_message_at
                if not unanswered or now - self._last_hello_at >= UNANSWERED_HELLO_RETRY_S:
                    self._send_hello()


async def _forever(loop: Callable[[], Awaitable[None]]) -> None:
    """Keeps one of the link's loops running: a bug hit by one message must not leave the gateway
    deaf to the engine."""
    while True:
        try:
            await loop()
        except Exception:
            logger.exception("%s failed; restarting it", loop.__name__)
            await asyncio.sleep(0.1)
