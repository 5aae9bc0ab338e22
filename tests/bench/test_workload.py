"""Workload files, random prompts and --num-prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember_bench.make_workload import SENTENCES, make_workload, mismatches
from ember_bench.workload import WORDS, BenchRequest, RandomPrompts, WorkloadError, load_workload, take
from ember_core.tokenizer import tokenizer_from_gguf


def write(tmp_path: Path, content: object) -> Path:
    path = tmp_path / "workload.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_loads_prompts_and_ignores_extra_keys(tmp_path: Path) -> None:
    items = [{"prompt": "hello", "max_tokens": 4, "prompt_tokens": 1}, {"prompt": [5, 6], "max_tokens": 1}]
    path = write(tmp_path, items)
    assert load_workload(path) == [BenchRequest("hello", 4), BenchRequest([5, 6], 1)]


def test_the_shipped_workload_loads() -> None:
    requests = load_workload(Path(__file__).parents[2] / "services/ember_bench/workloads/smollm2.json")
    assert len(requests) == 32 and sum(r.max_tokens for r in requests) == 3890


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ({"prompt": "x", "max_tokens": 1}, "non-empty JSON list"),
        ([], "non-empty JSON list"),
        (["just a string"], "item 0: expected an object"),
        ([{"max_tokens": 3}], "item 0: 'prompt' must be"),
        ([{"prompt": "", "max_tokens": 3}], "item 0: 'prompt' must be"),
        ([{"prompt": [1, "2"], "max_tokens": 3}], "item 0: 'prompt' must be"),
        ([{"prompt": "ok", "max_tokens": 3}, {"prompt": "x", "max_tokens": 0}], "item 1: 'max_tokens'"),
        ([{"prompt": "x", "max_tokens": "5"}], "'max_tokens' must be an integer"),
        ([{"prompt": "x", "max_tokens": True}], "'max_tokens' must be an integer"),
    ],
)
def test_bad_workloads_are_clear_errors(tmp_path: Path, content: object, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(write(tmp_path, content))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read workload"):
        load_workload(tmp_path / "absent.json")


def test_random_prompts_are_seeded() -> None:
    random = RandomPrompts(count=3, input_len=7, output_len=5, seed=1)
    requests = random.words()
    assert requests == RandomPrompts(3, 7, 5, seed=1).words() != RandomPrompts(3, 7, 5, seed=2).words()
    assert all(r.max_tokens == 5 and len(r.prompt.split()) == 7 for r in requests)
    assert all(word in WORDS for r in requests for word in r.prompt.split())
    token_requests = random.token_ids(vocab_size=50)
    assert all(len(r.prompt) == 7 and all(1 <= t < 50 for t in r.prompt) for r in token_requests)


def test_random_prompt_settings_are_checked() -> None:
    with pytest.raises(WorkloadError, match="--random-input-len must be >= 1"):
        RandomPrompts(count=3, input_len=0, output_len=5)


def test_take_limits_or_cycles() -> None:
    requests = [BenchRequest("a", 1), BenchRequest("b", 2), BenchRequest("c", 3)]
    assert take(requests, None) == requests
    assert take(requests, 2) == requests[:2]
    assert [r.prompt for r in take(requests, 7)] == list("abcabca")
    with pytest.raises(WorkloadError, match="--num-prompts"):
        take(requests, 0)


def test_the_shipped_workload_counts_its_prompts_as_the_smollm2_tokenizer_does(smollm2_reader) -> None:
    tokenizer = tokenizer_from_gguf(smollm2_reader)
    shipped = json.loads((Path(__file__).parents[2] / "services/ember_bench/workloads/smollm2.json").read_text())
    assert mismatches(tokenizer, shipped) == []


def test_made_workloads_have_the_shipped_shape_and_follow_their_seed(smollm2_reader) -> None:
    tokenizer = tokenizer_from_gguf(smollm2_reader)
    workload = make_workload(tokenizer, count=12, seed=5)
    assert make_workload(tokenizer, count=12, seed=5) == workload != make_workload(tokenizer, count=12, seed=6)
    assert mismatches(tokenizer, workload) == []
    assert all(16 <= item["prompt_tokens"] <= 128 and 16 <= item["max_tokens"] <= 256 for item in workload)
    assert all(any(sentence.startswith(str(item["prompt"])[:20]) for sentence in SENTENCES) for item in workload)
