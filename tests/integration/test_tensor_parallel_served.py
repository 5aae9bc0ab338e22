"""A two-rank engine (`ember serve --tensor-parallel-size 2`) behind the gateway answers a real
OpenAI client with the offline engine's tokens; when its follower rank is killed with four streams
in flight, the engine goes down at once, restarts under `ember serve`, and every stream ends with
the same text."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai

from ember_bench.random_models import random_checkpoint
from ember_core import LLM, SamplingParams
from tests.processes import STARTUP_TIMEOUT_S, child_pids, free_port, spawned, stop_process, wait_until

PROMPTS = ["Split across two ranks", "One model, two processes", "A rank goes down", "The stream goes on"]


def _follower_pids(engine_pid: int) -> list[int]:
    children = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_a_two_rank_engine_serves_and_survives_a_lost_rank(tmp_path: Path) -> None:
    model_dir = random_checkpoint("qwen2", tmp_path / "model")
    request = {"max_tokens": 100, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with LLM(str(model_dir), dtype="float32", num_blocks=64, tensor_parallel_size=2) as llm:
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        expected = [output.outputs[0].text for output in llm.generate(PROMPTS, params)]
    port, log = free_port(), tmp_path / "serve.log"
    argv = ["-m", "ember_cli", "serve", "--model", str(model_dir), "--model-name", "tp", "--port", str(port),
            "--dtype", "float32", "--num-blocks", "64", "--tensor-parallel-size", "2", "--engine-resume-wait", "120"]  # fmt: skip
    with spawned(argv, log) as process:
        wait_until(lambda: process.poll() is not None or "ember: ready" in log.read_text(), STARTUP_TIMEOUT_S, "serve")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="tp", prompt=PROMPTS[0], **request)
        assert answer.choices[0].text == expected[0]
        engine = child_pids(process.pid, "ember_engine")[0]
        (follower,) = _follower_pids(engine)
        streams = [client.completions.create(model="tp", prompt=prompt, **request, stream=True) for prompt in PROMPTS]
        texts = [next(iter(stream)).choices[0].text for stream in streams]  # all four in flight
        os.kill(follower, signal.SIGKILL)
        texts = [text + "".join(chunk.choices[0].text for chunk in stream) for text, stream in zip(texts, streams)]
        assert texts == expected
        assert "tensor-parallel rank" in log.read_text()
        wait_until(lambda: engine not in child_pids(process.pid, "ember_engine"), 30, "the old engine's exit")
        chat = client.chat.completions.create(model="tp", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].message.content is not None
        process.send_signal(signal.SIGTERM)
        assert stop_process(process, timeout=30) == 0
