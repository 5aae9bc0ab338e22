"""Gateway settings: one frozen dataclass, validated once; the CLI flags and env vars are made from it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ember_gateway.engines.router import ROUTING_MODES


def read_keys(keys: str | None, key_file: str | None, flag: str) -> tuple[bytes, ...]:
    """The keys of a comma-separated flag and a file of one a line (blank lines skipped); ValueError
    naming `flag` for a file that cannot be read or holds none."""
    listed = [key.strip() for key in (keys or "").split(",") if key.strip()]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag}-file {key_file}: cannot be read ({type(exc).__name__})") from None
        from_file = [line.strip() for line in lines if line.strip()]
        if not from_file:
            raise ValueError(f"{flag}-file {key_file} holds no key")
        listed += from_file
    return tuple(key.encode() for key in listed)


@dataclass(frozen=True)
class GatewayConfig:
    """Each field's docstring is its flag's help (cli.py) and its row in the README's flag table."""

    engine_addresses: tuple[str, ...]
    """engine address: tcp://HOST:PORT, ipc://PATH, or dns+tcp://NAME:PORT for every address NAME
    resolves to (looked up every 2 s: a Kubernetes headless Service, a compose service)"""
    routing: str = "kv"
    """which engine takes a request: kv (where its prefix is cached, weighed against load), load, or
    round-robin"""
    host: str = "127.0.0.1"
    """the address to listen on"""
    port: int = 8000
    """the port to listen on; 0 picks a free port"""
    api_key: str | None = None
    """require `Authorization: Bearer KEY` (the dashboard: or `?key=KEY`) on every route but /health,
    /metrics, /openapi.json and the dashboard's files; several keys comma-separated"""
    api_key_file: str | None = None
    """a file of API keys, one a line, read at start (besides --api-key's)"""
    admin_api_key: str | None = None
    """keys (comma-separated) that alone may change what the server runs: load and unload adapters,
    where a user key then gets 403; they open every other route too. Unset: a user key may"""
    admin_api_key_file: str | None = None
    """a file of admin API keys, one a line, read at start (besides --admin-api-key's)"""
    allow_runtime_lora_updating: bool = False
    """serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter; off, they answer 404 as unknown
    routes do (the engines refuse such loads too unless started with it)"""
    max_pending: int = 256
    """engine requests (prompts x n) in flight before answering 429"""
    request_timeout: float | None = None
    """seconds from a request's arrival before it is aborted"""
    max_body_bytes: int = 4 * 1024 * 1024
    """larger request bodies get 413"""
    model_name: str | None = None
    """served model name; none: the engine's model id"""
    # A killed engine is noticed at once through the socket's disconnect event instead.
    engine_timeout: float = 30.0
    """seconds of silence after which an engine counts as gone: hung or stopped, since it heartbeats
    during long steps too"""
    allowed_origins: tuple[str, ...] = ("*",)
    """comma-separated origins browsers may call from (CORS); `*` any, empty none"""
    # A gateway that just started (or was restarted by `ember serve`) is ready a moment after its engine.
    engine_wait: float = 5.0
    """seconds a request arriving while no engine is ready waits for one before 503"""
    engine_resume_wait: float = 0.0
    """seconds requests in flight on a lost engine wait for a restarted one serving the same model,
    which continues them where they were; 0: they fail at once"""
    # The HTTP edge (connections.py).
    header_timeout: float = 10.0
    """seconds from a request's first byte to the end of its headers, else the connection is closed"""
    body_timeout: float = 10.0
    """longest wait for more of a request body (a minimum body rate), else 408"""
    keepalive_timeout: float = 30.0
    """seconds an idle connection is kept open between requests"""
    max_connections: int = 1024
    """open HTTP connections; more are answered 503 at accept"""
    otlp_traces_endpoint: str | None = None
    """export each request's OpenTelemetry spans over OTLP/HTTP to this URL, e.g.
    http://collector:4318 (its /v1/traces); a `traceparent` header makes them part of the caller's
    trace. `ember serve` passes it to its engines too"""
    listen_fd: int | None = None
    """serve on this inherited listening socket instead of binding --host/--port (what `ember serve`
    passes)"""

    def api_keys(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """The user keys and the admin keys, the files read now; ValueError for a file that cannot be."""
        return (
            read_keys(self.api_key, self.api_key_file, "--api-key"),
            read_keys(self.admin_api_key, self.admin_api_key_file, "--admin-api-key"),
        )

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
        if self.admin_api_key == "":
            raise ValueError("admin_api_key must not be empty (leave it unset: user keys may change adapters)")
        users, admins = self.api_keys()
        if set(users) & set(admins):
            raise ValueError("a key is both a user key and an admin key: give admins keys of their own")
        if self.model_name == "":
            raise ValueError("model_name must not be empty")
        if self.otlp_traces_endpoint is not None:
            from ember_core.tracing import traces_url  # OpenTelemetry: imported only when tracing is on

            traces_url(self.otlp_traces_endpoint)  # raises ValueError for one that is no URL
