"""Real processes for integration tests: free loopback ports, spawn, bounded waits, always stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

STARTUP_TIMEOUT_S = 90.0  # torch import and model load on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def stop_process(process: subprocess.Popen, timeout: float = 15.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@contextmanager
def spawned(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Start argv (a python -m module and its flags) with output to log_path; stop it on exit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield process
        finally:
            stop_process(process)


def engine_argv(model_dir: Path | str, address: str, *extra: str) -> list[str]:
    return ["-m", "ember_engine", "--model", str(model_dir), "--bind", address, "--device", "cpu", "--dtype", "float32", *extra]


def http_status(request: str | urllib.request.Request, timeout: float = 2) -> int:
    """The response's status; 0 when nothing answered."""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def gateway_argv(engine_address: str, port: int, *extra: str) -> list[str]:
    return ["-m", "ember_gateway", "--engine", engine_address, "--port", str(port), "--log-level", "WARNING", *extra]


def start_gateway(engine_address: str, log: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A gateway process on a free port, yielded as its base URL once /health is 200."""
    port = free_port()
    with spawned(gateway_argv(engine_address, port, *extra), log, env) as process:
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: process.poll() is not None or http_status(f"{url}/health") == 200, STARTUP_TIMEOUT_S, "a gateway"
        )
        assert process.poll() is None, log.read_text()
        yield url


@contextmanager
def served(model: Path | str, log: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`ember serve --model MODEL --dtype float32` on a free port, yielded as its base URL once
    /health is 200; stopped on exit."""
    port = free_port()
    argv = ["-m", "ember_cli", "serve", "--model", str(model), "--port", str(port), "--dtype", "float32", *extra]
    with spawned(argv, log, env) as process:
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: process.poll() is not None or http_status(f"{url}/health") == 200, STARTUP_TIMEOUT_S, "ember serve"
        )
        assert process.poll() is None, log.read_text()
        yield url


def child_pids(serve_pid: int, module: str, exclude: list[int] | None = None) -> list[int]:
    """The pids of the processes serve_pid started that run `module` (ember_engine, ember_gateway)."""
    children = [int(child) for child in Path(f"/proc/{serve_pid}/task/{serve_pid}/children").read_text().split()]
    return [
        pid for pid in children if pid not in (exclude or []) and module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
