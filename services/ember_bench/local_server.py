"""`ember serve` started by a benchmark on a free loopback port, stopped when it is done."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

STARTUP_TIMEOUT_S = 300.0


@contextmanager
def local_server(model: str, engines: int, serve_args: list[str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """(url, the launcher's process) once `engines` engines are ready."""
    port = free_port()
    argv = [sys.executable, "-m", "ember_cli", "serve", "--model", model, "--port", str(port),
            "--log-level", "WARNING", *serve_args]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while engines_ready(url) < engines:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ember serve did not come up: {' '.join(argv)}")
            time.sleep(0.5)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=60)


def engines_ready(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return len(json.load(response)["engines"])
    except (OSError, ValueError, KeyError):
        return 0


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
