"""`ember serve` / `ember-serve`: one engine and one gateway as child processes, signals forwarded."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from ember_core.cli import add_engine_arguments, engine_kwargs_from_args

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 15.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember-serve", description="serve a model on an OpenAI-compatible HTTP API")
    add_engine_arguments(parser)
    parser.add_argument("--host", default=os.environ.get("EMBER_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=os.environ.get("EMBER_PORT", 8000))
    parser.add_argument("--api-key", default=os.environ.get("EMBER_API_KEY"))
    parser.add_argument("--log-level", default=os.environ.get("EMBER_LOG_LEVEL", "INFO"))
    return parser


def _engine_argv(args: argparse.Namespace, bind: str) -> list[str]:
    argv = [sys.executable, "-m", "ember_engine", "--bind", bind, "--log-level", args.log_level]
    for name, value in engine_kwargs_from_args(args).items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def _gateway_argv(args: argparse.Namespace, engine_address: str) -> list[str]:
    argv = [sys.executable, "-m", "ember_gateway", "--engine", engine_address, "--host", args.host, "--port", str(args.port)]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    return argv


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ember-") as run_dir:
        address = f"ipc://{run_dir}/engine.sock"
        engine = subprocess.Popen(_engine_argv(args, address))
        gateway = subprocess.Popen(_gateway_argv(args, address))
        children = [gateway, engine]  # the gateway stops first so clients see a clean close
        stop_requested = False

        def on_signal(*_) -> None:
            nonlocal stop_requested
            stop_requested = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        print(f"ember: serving {args.model} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        while not stop_requested and all(p.poll() is None for p in children):
            time.sleep(POLL_SECONDS)
        _stop(children)
    failed = [p for p in children if p.returncode not in (0, -signal.SIGTERM)]
    sys.exit(0 if stop_requested or not failed else 1)


if __name__ == "__main__":
    main()
