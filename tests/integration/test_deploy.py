"""Deployment files: compose and nginx validated by the real tools, manifests that point at real
things, and the project's nginx config in front of two real gateways."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.gateway.tiny_tokenizer import write_model_with_tokenizer
from tests.processes import engine_argv, free_port, http_status, spawned, start_gateway, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
needs_nginx = pytest.mark.skipif(not Path(NGINX).exists(), reason="nginx is not installed (make test installs it as root)")
needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose is not installed (make test installs it as root)"
)


def nginx_config_for(tmp_path: Path, listen_port: int, gateway_ports: list[int]) -> Path:
    """The project's nginx.conf with only its ports and paths moved onto this machine's loopback: the
    gateways, which Docker's DNS would name, are a server group of the same name on loopback ports
    (proxy_pass takes a group whose name the variable holds)."""
    text = (DEPLOY / "nginx.conf").read_text()
    servers = "".join(f"        server 127.0.0.1:{port};\n" for port in gateway_ports)
    upstream = f"    upstream local_gateways {{\n{servers}    }}"
    text, replaced = re.subn(r"^ *resolver .*;$", upstream, text, flags=re.MULTILINE)
    assert replaced == 1
    text, replaced = re.subn(r"set \$gateways gateway:8000;", "set $gateways local_gateways;", text)
    assert replaced == 1
    text, replaced = re.subn(r"listen 8000;", f"listen 127.0.0.1:{listen_port};", text)
    assert replaced == 1
    text = text.replace("/tmp/", f"{tmp_path}/")
    path = tmp_path / "nginx.conf"
    path.write_text(text)
    return path


@needs_compose
@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "deploy/docker-compose.gpu.yml"]])
def test_compose_files_are_valid(files: list[str]) -> None:
    args = [arg for f in files for arg in ("-f", f)]
    result = subprocess.run(["docker-compose", *args, "config", "-q"], cwd=ROOT, check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


@needs_nginx
def test_nginx_config_is_valid(tmp_path: Path) -> None:
    config = nginx_config_for(tmp_path, free_port(), [free_port()])
    result = subprocess.run([NGINX, "-t", "-e", "stderr", "-c", str(config)], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    text = (DEPLOY / "nginx.conf").read_text()
    assert "proxy_buffering off;" in text and "gzip on" not in text


def test_compose_names_only_files_ports_and_images_that_exist() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {name for name, service in services.items() if "profiles" not in service} == {"engine", "gateway", "lb"}
    for name in ("engine", "gateway"):
        dockerfile = ROOT / services[name]["build"]["dockerfile"]
        assert dockerfile.is_file()
        exposed = re.findall(r"^EXPOSE (\d+)", dockerfile.read_text(), flags=re.MULTILINE)
        assert exposed == [str(p) for p in services[name]["expose"]]
        assert "ports" not in services[name]  # only the load balancer is published
    assert services["lb"]["ports"] == ["${EMBER_HTTP_PORT:-8000}:8000"]
    nginx_mount = services["lb"]["volumes"][0].split(":")[0]
    assert (ROOT / nginx_mount).is_file()
    assert services["gateway"]["environment"]["EMBER_ENGINE"] == "dns+tcp://engine:5555"  # every scaled engine
    assert services["engine"]["environment"]["EMBER_BIND"] == "tcp://0.0.0.0:5555"


def test_dockerfiles_copy_only_paths_that_exist() -> None:
    for dockerfile in DEPLOY.glob("*.Dockerfile"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for source in line.split()[1:-1]:
                    assert (ROOT / source).exists(), f"{dockerfile.name}: {source}"
    gateway = (DEPLOY / "gateway.Dockerfile").read_text()
    requirements = [line.split(">=")[0] for line in (DEPLOY / "gateway-requirements.txt").read_text().splitlines()
                    if line and not line.startswith("#")]
    assert "torch" not in requirements and {"aiohttp", "pyzmq", "msgspec", "tiktoken"} <= set(requirements)
    assert "--no-deps" in gateway


def test_kubernetes_manifests_parse_and_match_the_images() -> None:
    images = {yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][s]["image"] for s in ("engine", "gateway")}
    documents = [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) if path.name != "kustomization.yaml"
                 for doc in yaml.safe_load_all(path.read_text())]
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in documents}
    assert {("Deployment", "ember-engine"), ("Deployment", "ember-gateway"), ("Service", "ember-engine"),
            ("Service", "ember-gateway"), ("HorizontalPodAutoscaler", "ember-gateway")} <= kinds
    for doc in documents:
        if doc["kind"] != "Deployment":
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] in images
        port = container["ports"][0]["containerPort"]
        dockerfile = DEPLOY / f"{container['name']}.Dockerfile"
        assert re.search(rf"^EXPOSE {port}$", dockerfile.read_text(), flags=re.MULTILINE)
        assert container["readinessProbe"] and container["livenessProbe"] and container["resources"]["requests"]
    engine_service = next(d for d in documents if (d["kind"], d["metadata"]["name"]) == ("Service", "ember-engine"))
    assert engine_service["spec"]["clusterIP"] == "None"  # headless: the gateways resolve every engine pod
    gateway = next(d for d in documents if (d["kind"], d["metadata"]["name"]) == ("Deployment", "ember-gateway"))
    env = {e["name"]: e["value"] for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["EMBER_ENGINE"] == "dns+tcp://ember-engine:5555"
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert all((DEPLOY / "k8s" / r).is_file() for r in kustomization["resources"])
    # the engine's unauthenticated ZeroMQ port admits the gateways' pods alone
    (policy,) = [d for d in documents if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == engine_service["spec"]["selector"]
    (rule,) = policy["spec"]["ingress"]
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert [peer["podSelector"]["matchLabels"] for peer in rule["from"]] == [gateway_labels]
    assert rule["ports"] == [{"protocol": "TCP", "port": 5555}] and policy["spec"]["policyTypes"] == ["Ingress"]
    gpu = yaml.safe_load((DEPLOY / "k8s" / "gpu" / "kustomization.yaml").read_text())
    assert "nvidia.com~1gpu" in gpu["patches"][0]["patch"]


def test_engine_probe_reports_readiness(tmp_path: Path, gpt2_dir: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    probe = [sys.executable, "-m", "ember_engine.probe", address]
    assert subprocess.run(probe, check=False, timeout=30).returncode == 1  # nothing there yet
    with spawned(engine_argv(gpt2_dir, address, "--num-blocks", "16"), tmp_path / "engine.log"):
        wait_until(lambda: subprocess.run(probe, check=False, timeout=30).returncode == 0, 90, "the engine probe")


async def _stream_chunk_times(session: aiohttp.ClientSession, url: str) -> tuple[list[float], list[str]]:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "stream": True,
            "temperature": 0}
    start = time.monotonic()
    times, payloads = [], []
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: "):
                times.append(time.monotonic() - start)
                payloads.append(line[6:].strip().decode())
    return times, payloads


@needs_nginx
async def test_nginx_streams_unbuffered_across_two_gateways_and_survives_losing_one(
    gpt2_dir: Path, tmp_path: Path
) -> None:
    model_dir = write_model_with_tokenizer(gpt2_dir, tmp_path / "model")
    address = f"tcp://127.0.0.1:{free_port()}"
    with spawned(engine_argv(model_dir, address, "--num-blocks", "128", "--served-model-name", "tiny"),
                 tmp_path / "engine.log"):
        first = start_gateway(address, tmp_path / "gw1.log")
        second = start_gateway(address, tmp_path / "gw2.log")
        gateway_urls = [next(first), next(second)]
        listen = free_port()
        config = nginx_config_for(tmp_path, listen, [int(u.rsplit(":", 1)[1]) for u in gateway_urls])
        nginx = ["-c", str(config), "-e", "stderr", "-g", "daemon off;"]
        with spawned(["-c", "import os, sys; os.execv(sys.argv[1], sys.argv[1:])", NGINX, *nginx],
                     tmp_path / "nginx.log") as lb:
            url = f"http://127.0.0.1:{listen}"
            wait_until(lambda: lb.poll() is not None or http_status(f"{url}/health") == 200, 30, "nginx")
            assert lb.poll() is None, (tmp_path / "nginx.log").read_text()
            async with aiohttp.ClientSession() as session:
                times, payloads = await _stream_chunk_times(session, url)
                assert payloads[-1] == "[DONE]" and len(payloads) >= 60  # a chunk may carry several tokens of one character
                # Chunks arrive as they are generated, not in one buffered burst at the end.
                assert times[0] < 0.5 * times[-1]
                results = await asyncio.gather(*(_stream_chunk_times(session, url) for _ in range(6)))
                assert all(p[-1] == "[DONE]" for _, p in results)
                first.close()  # one gateway goes away; new requests must not fail
                statuses = []
                for _ in range(8):
                    async with session.post(f"{url}/v1/completions",
                                            json={"model": "tiny", "prompt": "hi", "max_tokens": 3}) as response:
                        statuses.append(response.status)
                assert statuses == [200] * 8
        second.close()
