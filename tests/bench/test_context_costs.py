"""`ember bench context` against a served hybrid model: the measurements come back, and the
conversation's next turn is a prefix hit (it resumes from the first turn's state checkpoint)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from ember_bench.families import FAMILIES
from ember_bench.random_tokenizers import write_tokenizer
from tests.bench.helpers import read_json, run_bench_cli
from tests.families import VOCAB, write_hybrid_checkpoint
from tests.processes import served


def _prefix_hits(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("ember_prefix_cache_hits_total"))


def test_context_costs_of_a_hybrid_model(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    write_hybrid_checkpoint(model_dir)
    write_tokenizer(model_dir, "qwen2", FAMILIES["qwen2"].specials, VOCAB)
    out = tmp_path / "context.json"
    with served(model_dir, tmp_path / "serve.log", "--block-size", "4", "--num-blocks", "256") as url:
        code = run_bench_cli("context", "--url", url, "--short", "8", "--long", "120", "--turn", "60", "--output", "4",
                             "--rounds", "1", "--output-json", str(out))
        hits = _prefix_hits(url)
    assert code == 0
    result = read_json(out)
    assert (result["short_tokens"], result["long_tokens"], result["turn_tokens"]) == (8, 120, 60)
    assert all(result[key] > 0 for key in ("tpot_short_s", "tpot_long_s", "first_turn_ttft_s", "second_turn_ttft_s"))
    assert result["long_over_short"] == result["tpot_long_s"] / result["tpot_short_s"]
    # The next turn holds the first turn's 60 tokens and its 4-token answer (the last not computed).
    assert hits >= 60 // 4 * 4, json.dumps(result)
