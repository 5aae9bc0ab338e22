"""The LoRA adapters loaded on one engine, which the gateway serves as models of their own, and the
loads and unloads sent there, each waiting for the engine's AdapterDone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ember_proto import AdapterDone, Adapters, LoadAdapter, UnloadAdapter


class EngineAdapters:
    def __init__(self, address: str) -> None:
        self.address = address
        self.names: list[str] = []
        self._answers: dict[str, asyncio.Future[AdapterDone]] = {}

    def on_message(self, message: Adapters | AdapterDone, engine_id: str | None) -> None:
        if isinstance(message, Adapters):
            if message.engine_id == engine_id:  # not a restarted engine's, or a stale one
                self.names = message.names
            return
        answer = self._answers.pop(message.request_id, None)
        if answer is not None and not answer.done():
            answer.set_result(message)

    async def change(
        self, send: Callable[[LoadAdapter | UnloadAdapter], bool], message: LoadAdapter | UnloadAdapter, timeout_s: float
    ) -> AdapterDone:
        """The engine's answer; a 503 when the message cannot go, or the engine does not answer in
        time (an adapter's download from the Hub included)."""
        if not send(message):
            return AdapterDone(message.request_id, 503, f"engine {self.address} is not taking requests")
        answer: asyncio.Future[AdapterDone] = asyncio.get_running_loop().create_future()
        self._answers[message.request_id] = answer
        try:
            done = await asyncio.wait_for(answer, timeout_s)
        except TimeoutError:
            return AdapterDone(message.request_id, 503, f"engine {self.address} did not answer in {timeout_s:g} s")
        finally:
            self._answers.pop(message.request_id, None)
        if done.code == 200:  # served from now on, before the engine's Adapters arrive
            others = [name for name in self.names if name != message.name]
            self.names = [*others, message.name] if isinstance(message, LoadAdapter) else others
        return done
