"""LoRA adapter loads and unloads that gateways ask for. A checkpoint is read on a thread of its own,
so the engine keeps stepping meanwhile; the copy into a slot, and unloads, happen between steps on
the worker's thread.

The engine is the last line of defence: whatever a gateway sends, it refuses every change unless
started with --allow-runtime-lora-updating, and reads only what its RuntimeAdapterPolicy allows. An
answer carries ember's own words (AdapterError) and no library's text; the full reason of any
other failure goes to this log with the request's id."""

from __future__ import annotations

import logging
import queue
import threading

from ember_core.engine.engine import Engine
from ember_core.lora.errors import AdapterError
from ember_core.lora.sources import AdapterSource, RuntimeAdapterPolicy
from ember_core.lora.weights import AdapterWeights
from ember_proto import AdapterDone, LoadAdapter, UnloadAdapter

logger = logging.getLogger(__name__)

SWITCHED_OFF = "this engine loads and unloads no LoRA adapters while serving (start it with --allow-runtime-lora-updating)"


class AdapterLoads:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        config = engine.config
        self.policy = RuntimeAdapterPolicy(config.lora_dir, config.allow_lora_from_hub) if config.allow_runtime_lora_updating else None
        self._read: queue.SimpleQueue[tuple[bytes, LoadAdapter, AdapterWeights | Exception]] = queue.SimpleQueue()

    @property
    def names(self) -> list[str]:
        return [] if self.engine.adapters is None else self.engine.adapters.names

    def load(self, identity: bytes, message: LoadAdapter) -> AdapterDone | None:
        """The answer now when the load cannot start, else None: finished() gives it later."""
        if self.policy is None:
            return self._refused(message.request_id, 403, SWITCHED_OFF)
        if self.engine.adapters is None:
            return AdapterDone(message.request_id, 400, "this engine serves no LoRA adapters: start it with --enable-lora")
        if message.name in self.names:
            return AdapterDone(message.request_id, 400, f"a LoRA adapter named {message.name!r} is loaded already")
        try:
            source = self.policy.source(message.path)
        except AdapterError as refusal:
            return self._refused(message.request_id, 400, str(refusal), f"lora_path {message.path!r}")
        threading.Thread(target=self._read_checkpoint, args=(identity, message, source), name="adapter-read", daemon=True).start()
        return None

    def _read_checkpoint(self, identity: bytes, message: LoadAdapter, source: AdapterSource) -> None:
        try:
            self._read.put((identity, message, self.engine.read_adapter(source)))
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
            except AdapterError as exc:  # a bad file, a wrong base, no room: in ember's own words
                reason = f"cannot load adapter {message.name!r}: {exc}"
                answers.append((identity, self._refused(message.request_id, 400, reason, f"lora_path {message.path!r}")))
            except Exception:
                logger.exception("request %s: loading adapter %r from %r failed", message.request_id, message.name, message.path)
                reason = f"cannot load adapter {message.name!r}: its files could not be read (request {message.request_id})"
                answers.append((identity, AdapterDone(message.request_id, 400, reason)))
            else:
                answers.append((identity, AdapterDone(message.request_id, 200)))
        return answers

    def unload(self, message: UnloadAdapter) -> AdapterDone:
        if self.policy is None:
            return self._refused(message.request_id, 403, SWITCHED_OFF)
        try:
            self.engine.remove_adapter(message.name)
        except LookupError as exc:
            return AdapterDone(message.request_id, 404, str(exc))
        except ValueError as exc:
            return AdapterDone(message.request_id, 409, str(exc))
        return AdapterDone(message.request_id, 200)

    @staticmethod
    def _refused(request_id: str, code: int, reason: str, detail: str = "") -> AdapterDone:
        logger.warning("request %s: adapter change refused%s: %s", request_id, f" ({detail})" if detail else "", reason)
        return AdapterDone(request_id, code, reason)
