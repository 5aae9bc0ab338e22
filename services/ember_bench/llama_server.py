"""llama.cpp for the benchmarks and checks that compare against it: its `llama-server` run as a
context manager on a free loopback port, and a build of its tools from the sources that the
llama-cpp-python sdist vendors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from ember_bench.local_server import free_port

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # llama.cpp 0c1e57098, the version docs/benchmarks.md measured
LLAMA_CPP_TARGETS = ("llama-server", "llama-quantize")
SERVER_START_S = 120.0


class LlamaServer:
    """`llama-server -m MODEL ARGS...` on 127.0.0.1, its output in log_path; ready once /health says so."""

    def __init__(self, binary: Path, model: Path, log_path: Path, server_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.command = [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), *server_args,
        ]
        self.log_path = log_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.close()
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become healthy in {SERVER_START_S:.0f} s; see {self.log_path}")

    def __exit__(self, *exc_info: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Greedy tokens, up to and including an end-of-generation token. (ignore_eos would not
        do: llama.cpp bans every token it counts as end-of-generation, transformers none.)"""
        reply = self._post("/completion", {
            "prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True,
        })
        if len(reply["tokens"]) < new_tokens and reply["stop_type"] != "eos":
            raise RuntimeError(f"llama-server stopped after {len(reply['tokens'])} tokens: {reply['stop_type']}")
        return reply["tokens"]

    def tokenize(self, text: str) -> list[int]:
        return self._post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())


def build_llama_cpp(work_dir: Path, targets: Sequence[str] = LLAMA_CPP_TARGETS) -> Path:
    """The bin directory of a llama.cpp build in work_dir holding every target: reused when there,
    else the llama-cpp-python sdist is downloaded, unpacked and built (Release, native CPU, no curl)."""
    source = work_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    bin_dir = source / "build" / "bin"
    if all((bin_dir / target).is_file() for target in targets):
        return bin_dir
    if not source.is_dir():
        _unpack(_download_sdist(work_dir), work_dir)
    _run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"], source)
    _run(["cmake", "--build", "build", f"-j{os.cpu_count() or 1}", "--target", *targets], source)
    return bin_dir


def _download_sdist(work_dir: Path) -> Path:
    sdist = work_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.is_file():
        work_dir.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(work_dir)], work_dir)
    return sdist


def _unpack(sdist: Path, work_dir: Path) -> None:
    with tarfile.open(sdist) as archive:
        archive.extractall(work_dir, filter="data")


def _run(command: list[str], cwd: Path) -> None:
    print(f"+ (cd {cwd} && {' '.join(command)})", file=sys.stderr, flush=True)
    subprocess.run(command, cwd=cwd, check=True)
