"""LoRA adapter loads and unloads that gateways ask for. A checkpoint is read on a thread of its own,
so the engine keeps stepping meanwhile; the copy into a slot, and unloads, happen between steps on
the worker's thread."""

from __future__ import annotations

import queue
import threading

from ember_core.engine.engine import Engine
from ember_core.lora.weights import AdapterWeights
from ember_proto import AdapterDone, LoadAdapter, UnloadAdapter


class AdapterLoads:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._read: queue.SimpleQueue[tuple[bytes, LoadAdapter, AdapterWeights | Exception]] = queue.SimpleQueue()

    @property
    def names(self) -> list[str]:
        return [] if self.engine.adapters is None else self.engine.adapters.names

    def load(self, identity: bytes, message: LoadAdapter) -> AdapterDone | None:
        """The answer now when the load cannot start, else None: finished() gives it later."""
        if self.engine.adapters is None:
            return AdapterDone(message.request_id, 400, "this engine serves no LoRA adapters: start it with --enable-lora")
        if message.name in self.names:
            return AdapterDone(message.request_id, 400, f"a LoRA adapter named {message.name!r} is loaded already")
        threading.Thread(target=self._read_checkpoint, args=(identity, message), name="adapter-read", daemon=True).start()
        return None

    def _read_checkpoint(self, identity: bytes, message: LoadAdapter) -> None:
        try:
            self._read.put((identity, message, self.engine.read_adapter(message.path)))
        except Exception as exc:  # noqa: BLE001 -- any failure to read is the load's answer, a 400
            self._read.put((identity, message, exc))

    def finished(self) -> list[tuple[bytes, AdapterDone]]:
        """Install the checkpoints read since the last call; each load's answer and its gateway."""
        answers = []
        while not self._read.empty():
            identity, message, adapter = self._read.get()
            try:
                if isinstance(adapter, Exception):
                    raise adapter
                self.engine.install_adapter(message.name, adapter)
            except Exception as exc:  # noqa: BLE001 -- a bad file, a wrong base, no free slot: the load's 400
                answers.append((identity, AdapterDone(message.request_id, 400, f"cannot load adapter {message.name!r}: {exc}")))
            else:
                answers.append((identity, AdapterDone(message.request_id, 200)))
        return answers

    def unload(self, message: UnloadAdapter) -> AdapterDone:
        try:
            self.engine.remove_adapter(message.name)
        except LookupError as exc:
            return AdapterDone(message.request_id, 404, str(exc))
        except ValueError as exc:
            return AdapterDone(message.request_id, 409, str(exc))
        return AdapterDone(message.request_id, 200)
