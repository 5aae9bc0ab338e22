"""`ember-gateway`: serve the OpenAI-compatible HTTP API in front of one or more engines."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys

from aiohttp import web

from ember_core.log_level import add_log_level_argument, configure_logging
from ember_gateway.app import create_app, start_runner
from ember_gateway.config import DEFAULT_MAX_BODY_BYTES, GatewayConfig
from ember_gateway.router import ROUTING_MODES
from ember_gateway.state import STATE

logger = logging.getLogger("ember_gateway")

# In-flight requests get this long to finish after SIGTERM before their connections are closed.
SHUTDOWN_GRACE_S = 10.0


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
    return seconds


def _positive_seconds(value: str) -> float:
    seconds = _seconds(value)
    if seconds == 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value!r}")
    return seconds


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP front end's options (all but --engine and --log-level), shared with `ember serve`."""
    env = os.environ.get
    parser.add_argument("--host", default=env("EMBER_HOST", "127.0.0.1"), help="(EMBER_HOST)")
    parser.add_argument("--port", type=int, default=env("EMBER_PORT", "8000"), help="0 picks a free port (EMBER_PORT)")
    parser.add_argument(
        "--api-key", default=env("EMBER_API_KEY"), help="require `Authorization: Bearer KEY` on /v1 (EMBER_API_KEY)"
    )
    parser.add_argument(
        "--max-pending", type=int, default=env("EMBER_MAX_PENDING", "256"),
        help="engine requests (prompts x n) in flight before answering 429 (EMBER_MAX_PENDING)",
    )
    parser.add_argument(
        "--request-timeout", type=_positive_seconds, default=env("EMBER_REQUEST_TIMEOUT"),
        help="seconds a request may take before it is aborted; default none (EMBER_REQUEST_TIMEOUT)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=env("EMBER_MAX_BODY_BYTES", str(DEFAULT_MAX_BODY_BYTES)),
        help="larger request bodies get 413 (EMBER_MAX_BODY_BYTES)",
    )
    parser.add_argument(
        "--header-timeout", type=_positive_seconds, default=env("EMBER_HEADER_TIMEOUT", "10"),
        help="seconds from a request's first byte to the end of its headers, else the connection is closed "
        "(EMBER_HEADER_TIMEOUT)",
    )
    parser.add_argument(
        "--body-timeout", type=_positive_seconds, default=env("EMBER_BODY_TIMEOUT", "10"),
        help="longest wait for more of a request body (a minimum body rate), else 408 (EMBER_BODY_TIMEOUT)",
    )
    parser.add_argument(
        "--keepalive-timeout", type=_positive_seconds, default=env("EMBER_KEEPALIVE_TIMEOUT", "30"),
        help="seconds an idle connection is kept open between requests (EMBER_KEEPALIVE_TIMEOUT)",
    )
    parser.add_argument(
        "--max-connections", type=int, default=env("EMBER_MAX_CONNECTIONS", "1024"),
        help="open HTTP connections; more are answered 503 at accept (EMBER_MAX_CONNECTIONS)",
    )
    parser.add_argument(
        "--model-name", default=env("EMBER_MODEL_NAME"),
        help="served model name; default the engine's model id (EMBER_MODEL_NAME)",
    )
    parser.add_argument(
        "--engine-timeout", type=_positive_seconds, default=env("EMBER_ENGINE_TIMEOUT", "30"),
        help="seconds of engine silence before it counts as gone (a hung engine; it heartbeats during long steps) (EMBER_ENGINE_TIMEOUT)",
    )
    parser.add_argument(
        "--engine-wait", type=_seconds, default=env("EMBER_ENGINE_WAIT", "5"),
        help="seconds a request arriving while no engine is ready waits for one before 503 (EMBER_ENGINE_WAIT)",
    )
    parser.add_argument(
        "--engine-resume-wait", type=_seconds, default=env("EMBER_ENGINE_RESUME_WAIT", "0"),
        help="seconds requests in flight on a lost engine wait for a restarted one, which continues them where they "
        "were; 0: they fail at once (EMBER_ENGINE_RESUME_WAIT)",
    )
    parser.add_argument(
        "--routing", choices=ROUTING_MODES, default=env("EMBER_ROUTING", "kv"),
        help="which engine takes a request: kv (where its prefix is cached, weighed against load), load, or "
        "round-robin (EMBER_ROUTING)",
    )
    parser.add_argument(
        "--allowed-origins", default=env("EMBER_ALLOWED_ORIGINS", "*"),
        help="comma-separated origins browsers may call from (CORS); * any, empty none (EMBER_ALLOWED_ORIGINS)",
    )


def gateway_options_argv(args: argparse.Namespace) -> list[str]:
    """The gateway options in `args` as command-line flags, for a launcher that starts the gateway."""
    options = argparse.ArgumentParser(add_help=False)
    add_gateway_arguments(options)
    argv: list[str] = []
    for name in vars(options.parse_args([])):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember-gateway", description="OpenAI-compatible gateway for ember engines")
    parser.add_argument(
        "--engine", action="append",
        help="engine address: tcp://HOST:PORT, ipc://PATH, or dns+tcp://NAME:PORT for every address NAME resolves to "
        "(looked up every 2 s); repeat the flag or separate addresses by commas "
        "(EMBER_ENGINE; default tcp://127.0.0.1:5555)",
    )
    add_gateway_arguments(parser)
    parser.add_argument(
        "--listen-fd", type=int, default=None,
        help="serve on this inherited listening socket instead of binding --host/--port (what `ember serve` passes)",
    )
    add_log_level_argument(parser)
    return parser


def engine_addresses(values: list[str]) -> tuple[str, ...]:
    return tuple(address.strip() for value in values for address in value.split(",") if address.strip())


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        engine_addresses=engine_addresses(args.engine or [os.environ.get("EMBER_ENGINE", "tcp://127.0.0.1:5555")]),
        routing=args.routing,
        host=args.host,
        port=args.port,
        listen_fd=args.listen_fd,
        api_key=args.api_key or None,
        max_pending=args.max_pending,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keepalive_timeout=args.keepalive_timeout,
        max_connections=args.max_connections,
        model_name=args.model_name or None,
        engine_timeout=args.engine_timeout,
        engine_wait=args.engine_wait,
        engine_resume_wait=args.engine_resume_wait,
        allowed_origins=tuple(origin.strip() for origin in args.allowed_origins.split(",") if origin.strip()),
    )


async def serve(config: GatewayConfig) -> None:
    runner = await start_runner(create_app(config), shutdown_timeout=SHUTDOWN_GRACE_S)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if config.listen_fd is None:
            site: web.BaseSite = web.TCPSite(runner, config.host, config.port)
        else:
            site = web.SockSite(runner, socket.socket(fileno=config.listen_fd))
        await site.start()
        for address in runner.addresses:
            engines = ", ".join(config.engine_addresses)
            logger.info("listening on http://%s:%d (engines %s, routing %s)", address[0], address[1], engines, config.routing)
        await stop.wait()
        logger.info("shutting down")
        runner.app[STATE].pool.stop_resuming("the gateway is shutting down")
    finally:
        # Stops listening, lets in-flight requests finish, then closes the engine socket and the
        # zmq context (app cleanup).
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # e.g. the port is taken
        sys.exit(f"ember-gateway: error: {exc}")


if __name__ == "__main__":
    main()
