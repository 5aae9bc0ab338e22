"""`ember serve --speculative-config` on the default model, through the unmodified OpenAI SDK: the
greedy text of decoding without drafts, streamed and not, and vLLM's spec-decode counters on /metrics."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ember_core import LLM, SamplingParams
from tests.processes import served, wait_until

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPT = (
    "Repeat this list exactly.\n\nmilk, eggs, flour, butter, sugar, salt, yeast, honey, lemons, apples\n\n"
    "Repeated: milk, eggs,"
)
COUNTER = re.compile(r"^ember_spec_decode_(\w+)_total\{[^}]*\} (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def base_url(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("spec") / "serve.log"
    with served(smollm2_gguf_path, log, "--speculative-config", json.dumps(SPECULATIVE)) as base:
        yield base


def _counters(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        return {name: float(value) for name, value in COUNTER.findall(response.read().decode())}


def test_served_drafts_keep_the_greedy_text_and_are_counted(base_url: str, smollm2_gguf_path: Path) -> None:
    expected = LLM(str(smollm2_gguf_path), dtype="float32").generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    assert whole.choices[0].text == expected[0].text
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected[0].text
    wait_until(lambda: _counters(base_url).get("num_accepted_tokens", 0) > 0, 10, "accepted drafts in /metrics")
    counters = _counters(base_url)
    assert counters["num_drafts"] > 0
    assert counters["num_draft_tokens"] >= counters["num_accepted_tokens"]
    assert counters["num_emitted_tokens"] <= counters["num_accepted_tokens"] + counters["num_drafts"]
