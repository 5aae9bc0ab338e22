"""A mixture of experts served end to end: a random Qwen3-MoE checkpoint behind `ember serve`, whose
/metrics counts the tokens routed to each expert of each layer."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from tests.processes import served, wait_until

pytest.importorskip("transformers")
from ember_bench.random_models import random_checkpoint

TOP_K, EXPERTS, LAYERS = 2, 8, 2
EXPERT_LINE = re.compile(r'^ember_moe_expert_tokens_total\{.*expert="(\d+)",layer="(\d+)".*\} (\S+)$', re.MULTILINE)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = random_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe") / "model", num_hidden_layers=LAYERS,
                                  num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    with served(model_dir, model_dir.parent / "serve.log") as base:
        yield base


def _routed_per_layer(base: str) -> dict[int, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        text = response.read().decode()
    per_layer: dict[int, float] = {}
    for expert, layer, value in EXPERT_LINE.findall(text):
        assert 0 <= int(expert) < EXPERTS
        per_layer[int(layer)] = per_layer.get(int(layer), 0.0) + float(value)
    return per_layer


def test_metrics_count_every_token_each_layer_routed(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    computed = 0
    for prompt in ("Hello there", "A longer prompt about the experts of a sparse model"):
        usage = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=7,
                                          temperature=0).usage
        computed += usage.prompt_tokens + usage.completion_tokens - 1  # the last token is sampled, never run
    expected = {layer: float(TOP_K * computed) for layer in range(LAYERS)}
    # The load rides on the engine's messages at most once a second.
    wait_until(lambda: _routed_per_layer(base_url) == expected, 10, f"expert load {expected}")
