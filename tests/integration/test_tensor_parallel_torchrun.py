"""A two-rank engine whose ranks are started the way torchrun starts them on two nodes (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT): rank 0 as `ember serve`, rank 1 as a bare `ember_engine`
that follows it over gloo. The server answers a real OpenAI client with the offline two-rank
engine's tokens, and the follower leaves cleanly when the server stops."""

from __future__ import annotations

import signal
from pathlib import Path

import openai

from ember_bench.random_models import random_checkpoint
from ember_core import LLM, SamplingParams
from tests.processes import STARTUP_TIMEOUT_S, free_port, spawned, stop_process, wait_until

PROMPT = "Two nodes, one model"


def _torchrun_env(rank: int, master_port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}


def test_ranks_started_as_torchrun_starts_them_serve_one_model(tmp_path: Path) -> None:
    model_dir = random_checkpoint("qwen2", tmp_path / "model")
    with LLM(str(model_dir), dtype="float32", num_blocks=64, tensor_parallel_size=2) as llm:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        expected = llm.generate([PROMPT], params)[0].outputs[0].text
    port, master_port = free_port(), free_port()
    model_flags = ["--model", str(model_dir), "--dtype", "float32", "--num-blocks", "64", "--tensor-parallel-size", "2"]
    leader = ["-m", "ember_cli", "serve", *model_flags, "--model-name", "tp", "--port", str(port)]
    follower = ["-m", "ember_engine", *model_flags]
    leader_log, follower_log = tmp_path / "leader.log", tmp_path / "follower.log"
    with (
        spawned(leader, leader_log, _torchrun_env(0, master_port)) as server,
        spawned(follower, follower_log, _torchrun_env(1, master_port)) as rank_1,
    ):
        wait_until(lambda: server.poll() is not None or "ember: ready" in leader_log.read_text(), STARTUP_TIMEOUT_S, "serve")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="tp", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        assert answer.choices[0].text == expected
        server.send_signal(signal.SIGTERM)
        assert stop_process(server, timeout=30) == 0
        assert rank_1.wait(timeout=30) == 0, follower_log.read_text()[-2000:]
