"""`docker compose up` for real: the images built, the stack up, and the product checked through
nginx as a user would reach it. Deselected from `make test` (it installs and runs dockerd and builds
~2 GB of images); `make compose-smoke` runs it, and CI runs that beside the tests. It skips, saying
why, where dockerd cannot run. The tests share one stack and run in file order: the last ones scale
the gateways and the engines, and kill the engine."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from openai import OpenAI

from tests.deploy.docker_host import ROOT, DockerHost, docker_host, run
from tests.processes import free_port, http_status, wait_until

pytestmark = pytest.mark.compose

MODEL = "smollm2-135m-instruct"
ENGINE_USER_ID = 10001


@dataclass
class Stack:
    host: DockerHost
    env: dict[str, str]
    url: str

    def compose(self, *args: str, timeout: float = 300) -> str:
        result = run([*self.host.compose, *args], timeout, cwd=ROOT, env=self.env)
        assert result.returncode == 0, f"compose {' '.join(args)}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
        return result.stdout

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=60, max_retries=0)


def inspect(container: str, template: str) -> str:
    return run(["docker", "inspect", "-f", template, container], 30).stdout.strip()


def all_healthy(stack: Stack, service: str, count: int) -> bool:
    containers = stack.containers(service)
    return len(containers) == count and all(inspect(c, "{{.State.Health.Status}}") == "healthy" for c in containers)


def completion_status(stack: Stack) -> int:
    request = urllib.request.Request(
        f"{stack.url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode(),
    )
    return http_status(request, timeout=30)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("compose")
    with docker_host(work) as host:
        port = free_port()
        env = {**os.environ, "COMPOSE_PROJECT_NAME": f"embersmoke{os.getpid()}", "EMBER_HTTP_PORT": str(port)}
        stack = Stack(host, env, f"http://127.0.0.1:{port}")
        started = time.monotonic()
        try:
            stack.compose("build", *host.build_args, timeout=1200)
            built = time.monotonic()
            stack.compose("up", "-d", timeout=600)
            wait_until(lambda: http_status(f"{stack.url}/health") == 200, 300, "the stack's /health through nginx", 1)
            healthy = time.monotonic()
            sizes = {image: inspect(image, "{{.Size}}") for image in ("ember-engine:latest", "ember-gateway:latest")}
            print(f"\ncompose smoke: built in {built - started:.0f} s, healthy {healthy - built:.0f} s after `up`; "
                  + ", ".join(f"{image} {int(size) / 1e6:.0f} MB" for image, size in sizes.items()))
            yield stack
        finally:
            run([*host.compose, "down", "-v", "--remove-orphans"], 300, cwd=ROOT, env=env)
            run(["docker", "rmi", "-f", "ember-engine:latest", "ember-gateway:latest"], 300)


def test_health_and_a_chat_completion_through_nginx(stack: Stack) -> None:
    with urllib.request.urlopen(f"{stack.url}/health", timeout=10) as response:
        assert json.load(response)["model"] == MODEL
    reply = stack.client().chat.completions.create(
        model=MODEL, temperature=0, max_tokens=16,
        messages=[{"role": "system", "content": "Answer in one sentence."},
                  {"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in reply.choices[0].message.content


def test_a_streamed_completion_arrives_in_pieces(stack: Stack) -> None:
    start = time.monotonic()
    arrivals = []
    stream = stack.client().completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.monotonic() - start)
    assert len(arrivals) >= 24
    assert arrivals[0] < 0.5 * arrivals[-1]  # as generated, not one buffered burst at the end


def test_the_engine_user_writes_the_hub_cache(stack: Stack) -> None:
    (engine,) = stack.containers("engine")
    script = (
        "import os, pathlib; from huggingface_hub import constants; p = pathlib.Path(constants.HF_HUB_CACHE); "
        "p.mkdir(parents=True, exist_ok=True); (p / 'write-check').write_text('ok'); print(os.getuid())"
    )
    result = run(["docker", "exec", engine, "python", "-c", script], 60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(ENGINE_USER_ID)


def test_the_engine_runs_the_ops_built_into_its_image(stack: Stack) -> None:
    log = stack.compose("logs", "--no-color", "engine")
    assert re.search(r"CPU kernels: the \w+ build loaded from", log), log[-3000:]
    assert "CPU kernels: compiled" not in log


def test_scaled_gateways_share_requests_and_scaling_back_loses_none(stack: Stack) -> None:
    stack.compose("up", "-d", "--scale", "gateway=3")
    wait_until(lambda: all_healthy(stack, "gateway", 3), 120, "three healthy gateways", 1)
    time.sleep(6)  # nginx asks Docker's DNS again after 5 s

    def served(container: str) -> float:
        address = inspect(container, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
        with urllib.request.urlopen(f"http://{address}:8000/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith("ember_request_success_total"))

    gateways = stack.containers("gateway")
    before = {gateway: served(gateway) for gateway in gateways}
    assert [completion_status(stack) for _ in range(30)] == [200] * 30
    assert all(served(gateway) > before[gateway] for gateway in gateways), "a gateway got no request"

    stack.compose("up", "-d", "--scale", "gateway=1")
    durations = []
    for _ in range(15):  # nginx still holds the removed gateways' addresses for up to 5 s
        started = time.monotonic()
        assert completion_status(stack) == 200
        durations.append(time.monotonic() - started)
    print(f"\ncompose smoke: after scaling back to 1 gateway, the slowest of 15 requests took {max(durations):.2f} s")
    assert max(durations) < 5


def test_scaled_engines_share_requests_and_scaling_back_loses_none(stack: Stack) -> None:
    def engines_seen() -> int:
        with urllib.request.urlopen(f"{stack.url}/health", timeout=10) as response:
            return len(json.load(response)["engines"])

    def prompts_by_engine() -> dict[str, float]:
        with urllib.request.urlopen(f"{stack.url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        found = (re.match(r'ember_prefix_cache_queries_total\{engine="([^"]+)".*\} (\S+)$', line) for line in lines)
        return {match[1]: float(match[2]) for match in found if match}

    stack.compose("up", "-d", "--scale", "engine=2")
    wait_until(lambda: all_healthy(stack, "engine", 2), 300, "two healthy engines", 1)
    wait_until(lambda: engines_seen() == 2, 30, "the gateway to find the second engine by DNS", 1)
    before = prompts_by_engine()
    for index in range(20):  # unrelated prompts: the router spreads them by load
        reply = stack.client().completions.create(model=MODEL, prompt=f"Fact {index}: the sky", max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")
    after = prompts_by_engine()
    assert len(after) == 2 and all(after[engine] > before.get(engine, 0) for engine in after), (before, after)

    streams = [
        stack.client().completions.create(
            model=MODEL, prompt=f"Story {index}:", max_tokens=64, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for index in range(4)
    ]
    stack.compose("up", "-d", "--scale", "engine=1")  # one engine drains and stops under the streams
    usages = [[chunk.usage for chunk in stream if chunk.usage] for stream in streams]
    assert [[usage.completion_tokens for usage in usage_chunks] for usage_chunks in usages] == [[64]] * 4
    wait_until(lambda: engines_seen() == 1, 30, "the gateway to drop the removed engine", 1)


def test_a_killed_engine_process_is_restarted_and_serves_again(stack: Stack) -> None:
    (engine,) = stack.containers("engine")
    os.kill(int(inspect(engine, "{{.State.Pid}}")), signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: completion_status(stack) == 200, 180, "a completion after the engine was killed", 0.5)
    print(f"\ncompose smoke: a killed engine process served again after {time.monotonic() - killed:.1f} s")
    assert int(inspect(engine, "{{.RestartCount}}")) >= 1
