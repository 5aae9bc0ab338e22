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

from ember_core.config_flags import add_flags, comma_list, config_flags, config_kwargs, field_docs
from ember_core.log_level import add_log_level_argument, configure_logging
from ember_gateway.app import create_app, start_runner
from ember_gateway.config import GatewayConfig
from ember_gateway.engines.router import ROUTING_MODES
from ember_gateway.state import STATE

logger = logging.getLogger("ember_gateway")

DEFAULT_ENGINE = "tcp://127.0.0.1:5555"
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


GATEWAY_FLAGS = config_flags(
    GatewayConfig,
    skip=("engine_addresses",),  # --engine: repeatable, so build_parser declares it
    parse={
        "request_timeout": _positive_seconds, "engine_timeout": _positive_seconds, "header_timeout": _positive_seconds,
        "body_timeout": _positive_seconds, "keepalive_timeout": _positive_seconds,
        "engine_wait": _seconds, "engine_resume_wait": _seconds,
    },
    choices={"routing": ROUTING_MODES},
    no_env=("listen_fd",),
)
# --listen-fd is what a launcher passes, not one of the options `ember serve` takes; the engine's
# flag of the same name sets --allow-runtime-lora-updating there, for its engines and its gateway alike.
_LAUNCHER_SETS = ("listen_fd", "allow_runtime_lora_updating")
_SHARED_FLAGS = [flag for flag in GATEWAY_FLAGS if flag.field not in _LAUNCHER_SETS]


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP front end's options (all but --engine, --listen-fd and --log-level), shared with `ember serve`."""
    add_flags(parser, _SHARED_FLAGS)


def gateway_options_argv(args: argparse.Namespace) -> list[str]:
    """The gateway options in `args` (and the engines' --allow-runtime-lora-updating) as command-line
    flags, for a launcher that starts the gateway."""
    argv = [part for flag in _SHARED_FLAGS for part in flag.argv(getattr(args, flag.field))]
    return argv + (["--allow-runtime-lora-updating"] if args.allow_runtime_lora_updating else [])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember-gateway", description="OpenAI-compatible gateway for ember engines")
    parser.add_argument(
        "--engine", action="append",
        help=f"{field_docs(GatewayConfig)['engine_addresses']}; repeat the flag or separate addresses by commas "
        f"(EMBER_ENGINE; default {DEFAULT_ENGINE})",
    )
    add_flags(parser, GATEWAY_FLAGS)
    add_log_level_argument(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    engines = ",".join(args.engine or [os.environ.get("EMBER_ENGINE", DEFAULT_ENGINE)])
    return GatewayConfig(engine_addresses=comma_list(engines), **config_kwargs(GATEWAY_FLAGS, args))


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
