"""Real processes for integration tests: free loopback ports, spawn, bounded waits, always stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


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
def spawned(argv: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """Start argv (a python -m module and its flags) with output to log_path; stop it on exit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield process
        finally:
            stop_process(process)


def engine_argv(model_dir: Path | str, address: str, *extra: str) -> list[str]:
    return ["-m", "ember_engine", "--model", str(model_dir), "--bind", address, "--device", "cpu", "--dtype", "float32", *extra]
