"""A Docker engine for the compose smoke test, on a machine that can run one: what is missing is
installed (Debian's docker.io, iptables, debootstrap), dockerd started, and where the usual sources
are out of reach, the base images built as stand-ins (deploy/standin-base-images.sh) and the
CPU torch wheel that pip finds here served to the image build. Whatever it added, it removes after.
Where any of this cannot be done, the test skips and says why."""

from __future__ import annotations

import functools
import http.server
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGES = ("python:3.11-slim", "nginx:1.27-alpine")
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu/torch/"
LOCAL_CA_FOLDER = Path("/usr/local/share/ca-certificates")  # Debian's place for a machine's own CAs
PIP_SETTINGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")


@dataclass
class DockerHost:
    compose: list[str]  # ["docker", "compose"] (v2) or ["docker-compose"] (v1)
    build_args: list[str] = field(default_factory=list)  # --build-arg NAME=VALUE, ...


def run(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout, **kwargs)


def succeeds(argv: list[str], timeout: float = 60) -> bool:
    try:
        return run(argv, timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except OSError:
        return False


def _install_missing() -> None:
    wanted = {"dockerd": "docker.io", "iptables": "iptables", "debootstrap": "debootstrap"}
    missing = [package for tool, package in wanted.items() if shutil.which(tool) is None]
    if not succeeds(["docker", "compose", "version"]) and shutil.which("docker-compose") is None:
        missing.append("docker-compose")
    if not missing:
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"the compose smoke test needs {', '.join(missing)}, and this machine has no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], 300, env=env)
    result = run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], 600, env=env)
    if result.returncode != 0:
        pytest.skip(f"apt-get could not install {', '.join(missing)}: {result.stderr.strip()[-300:]}")


@contextmanager
def _running_dockerd(log_path: Path) -> Iterator[None]:
    if succeeds(["docker", "info"]):
        yield
        return
    with open(log_path, "w") as log:
        daemon = subprocess.Popen(["dockerd", "--storage-driver=overlay2"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not succeeds(["docker", "info"], timeout=10):
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"dockerd cannot run on this machine: {log_path.read_text()[-400:]}")
            time.sleep(0.5)
        yield
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()


def _compose_command() -> list[str]:
    return ["docker", "compose"] if succeeds(["docker", "compose", "version"]) else ["docker-compose"]


def _image_present(image: str) -> bool:
    return succeeds(["docker", "image", "inspect", image])


def _base_images(cleanup: ExitStack) -> None:
    """The official base images, pulled; where Docker Hub is out of reach, stand-ins."""
    absent = [image for image in BASE_IMAGES if not _image_present(image)]
    if not absent:
        return
    cleanup.callback(lambda: run(["docker", "rmi", "-f", *absent], 120))
    if all(succeeds(["docker", "pull", image], timeout=300) for image in absent):
        return
    result = run([str(ROOT / "deploy" / "standin-base-images.sh")], 900)
    if result.returncode != 0:
        pytest.skip(f"Docker Hub is out of reach and the stand-in base images failed: {result.stderr[-400:]}")


def _bridge_gateway_address() -> str:
    """The host's address on Docker's default bridge: what a build container reaches the host at."""
    config = json.loads(run(["docker", "network", "inspect", "bridge"], 30).stdout)[0]["IPAM"]["Config"][0]
    return config.get("Gateway") or str(next(ipaddress.ip_network(config["Subnet"]).hosts()))


def _dockerfile_torch_spec() -> str:
    text = (ROOT / "deploy" / "engine.Dockerfile").read_text()
    return re.search(r'^ARG TORCH_SPEC="([^"]+)"', text, flags=re.MULTILINE).group(1)


class _QuietFileHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:
        pass  # pip asks for every dependency too; the 404s are expected


def _torch_source(cleanup: ExitStack, folder: Path) -> list[str]:
    """Build args for torch: none where PyTorch's CPU index answers; else the CPU wheel pip finds on
    this machine, served over HTTP on Docker's bridge for the build to fetch."""
    if reachable(PYTORCH_CPU_INDEX):
        return []
    spec = f"{_dockerfile_torch_spec()}+cpu"
    wheels = folder / "torch"
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(wheels), spec]
    if run(download, 600).returncode != 0:
        pytest.skip(f"PyTorch's CPU index is out of reach and pip finds no {spec} wheel on this machine")
    address = _bridge_gateway_address()
    handler = functools.partial(_QuietFileHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer((address, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cleanup.callback(server.shutdown)
    index = f"http://{address}:{server.server_address[1]}/"
    return [f"TORCH_SPEC={spec}", f"TORCH_PIP_ARGS=--extra-index-url {index} --trusted-host {address}"]


def _local_certificates(cleanup: ExitStack) -> None:
    """This machine's own CAs (a TLS-inspecting proxy's) into deploy/ca-certificates for the build."""
    target = ROOT / "deploy" / "ca-certificates"
    for certificate in LOCAL_CA_FOLDER.rglob("*.crt") if LOCAL_CA_FOLDER.is_dir() else []:
        copy = target / f"host-{certificate.name}"
        if not copy.exists():
            shutil.copyfile(certificate, copy)
            cleanup.callback(copy.unlink, missing_ok=True)


def _pip_settings() -> list[str]:
    return [f"{name}={os.environ[name]}" for name in PIP_SETTINGS if os.environ.get(name, "").startswith("http")]


@contextmanager
def docker_host(work: Path) -> Iterator[DockerHost]:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the compose smoke test runs dockerd, which needs root on Linux")
    _install_missing()
    with ExitStack() as cleanup:
        cleanup.enter_context(_running_dockerd(work / "dockerd.log"))
        _base_images(cleanup)
        torch_args = _torch_source(cleanup, work / "wheels")
        _local_certificates(cleanup)
        build_args = [arg for pair in [*torch_args, *_pip_settings()] for arg in ("--build-arg", pair)]
        yield DockerHost(_compose_command(), build_args)
