"""Gateway settings: one frozen dataclass, validated once; the CLI and env vars map onto it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ember_gateway.router import ROUTING_MODES

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    # The engines' ROUTERs: tcp://HOST:PORT, ipc://PATH, or dns+tcp://NAME:PORT (every address of
    # NAME, looked up every few seconds: a Kubernetes headless Service, a compose service).
    engine_addresses: tuple[str, ...]
    routing: str = "kv"  # which engine takes a request: router.ROUTING_MODES
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # Engine requests (prompts x n) this gateway keeps in flight before answering 429.
    max_pending: int = 256
    request_timeout: float | None = None  # seconds from arrival; None: no limit
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_name: str | None = None  # served model name; None: the engine's model id
    # Silence after which a connected engine counts as gone: a hung or stopped engine. It heartbeats
    # between steps and, from a thread, during long ones; a killed engine is noticed at once
    # through the socket's disconnect event instead.
    engine_timeout: float = 30.0
    # Origins browsers may call the API from (CORS); "*": any, empty: no CORS headers.
    allowed_origins: tuple[str, ...] = ("*",)
    # A request that arrives while no engine is ready waits this long for one before its 503: a
    # gateway that just started (or was restarted by `ember serve`) is ready a moment after its engine.
    engine_wait: float = 5.0
    # Requests in flight when the engine is lost wait this long for a restarted engine serving the
    # same model, which continues each after the tokens it already sent; 0: they fail at once.
    engine_resume_wait: float = 0.0
    # The HTTP edge (connections.py): seconds from a request's first byte to the end of its headers,
    # the longest wait for more of a request body, an idle connection's life, and open connections.
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    keepalive_timeout: float = 30.0
    max_connections: int = 1024
    # A listening socket inherited from a launcher (`ember serve`), served instead of binding host:port.
    listen_fd: int | None = None

    def __post_init__(self) -> None:
        if not self.engine_addresses:
            raise ValueError("at least one engine address is needed")
        for address in self.engine_addresses:
            if not address.startswith(("tcp://", "ipc://", "dns+tcp://")) or (
                address.startswith("dns+tcp://") and not address.rpartition(":")[2].isdigit()
            ):
                raise ValueError(
                    f"engine address must be tcp://HOST:PORT, ipc://PATH or dns+tcp://NAME:PORT, got {address!r}"
                )
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {self.routing!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        # `not 0 < x < inf` also rejects nan
        if self.request_timeout is not None and not 0 < self.request_timeout < math.inf:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("engine_wait", "engine_resume_wait"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if not 0 < self.engine_timeout < math.inf:
            raise ValueError(f"engine_timeout must be > 0 seconds, got {self.engine_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset to disable auth)")
        if self.model_name == "":
            raise ValueError("model_name must not be empty")
