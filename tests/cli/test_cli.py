"""`ember generate`: real completions, and one-line errors for bad arguments."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember_cli import main as cli
from ember_cli import serve
from ember_core import LLM


def run_ember(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember_cli", *args], check=False, capture_output=True, text=True, timeout=300, env=env
    )


def test_missing_model_path_is_a_one_line_error() -> None:
    result = run_ember("generate", "--model", "/no/such/model", "hello")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "does not exist" in result.stderr


def test_unreadable_model_files_are_errors_that_name_the_file(gpt2_dir: Path, smollm2_gguf_path: Path, tmp_path: Path) -> None:
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"not a model")
    bad_config = shutil.copytree(gpt2_dir, tmp_path / "bad-config")
    (bad_config / "config.json").write_text("{'n_layer': 2}")
    truncated = shutil.copytree(gpt2_dir, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    truncated_gguf = tmp_path / "truncated.gguf"
    with smollm2_gguf_path.open("rb") as gguf_file:
        truncated_gguf.write_bytes(gguf_file.read(2**20))
    for model, expected in [
        (not_gguf, "is a file but not a .gguf file"),
        (bad_config, f"{bad_config / 'config.json'} is not valid JSON"),
        (truncated, f"{weights} is not a readable safetensors file"),
        (truncated_gguf, f"{truncated_gguf} is not a readable GGUF file (truncated or corrupt?)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(expected)):  # the CLI prints a ValueError as one line
            LLM(str(model), device="cpu")
    result = run_ember("generate", "--model", str(not_gguf), "hello")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda config: [config], "config.json must hold a JSON object, not list"),
        (lambda config: {k: v for k, v in config.items() if k != "vocab_size"}, "config.json has no 'vocab_size'"),
        (lambda config: {**config, "n_head": "four"}, "config.json: n_head must be a positive integer, got 'four'"),
        (lambda config: {**config, "n_embd": -64}, "config.json: n_embd must be a positive integer, got -64"),
        (lambda config: {**config, "n_layer": 0}, "config.json: n_layer must be a positive integer, got 0"),
    ],
)
def test_malformed_config_values_are_errors_that_say_which(gpt2_dir: Path, tmp_path: Path, edit, expected: str) -> None:
    model = shutil.copytree(gpt2_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ValueError, match=re.escape(expected)):
        LLM(str(model), device="cpu")


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"num_blocks": 10**11}, "GiB free: lower --kv-cache-mib / --num-blocks"),
        ({"kv_cache_mib": 10**8}, "GiB free: lower --kv-cache-mib / --num-blocks"),
        ({"block_size": 10**6, "kv_cache_mib": 1}, "a KV cache of 1 MiB holds no block of 1000000 tokens"),
        ({"device": "meta"}, "device 'meta' is not supported"),
        ({"model": ""}, "model must name a model"),
    ],
)
def test_settings_the_machine_cannot_hold_fail_before_allocating(gpt2_dir: Path, settings: dict, expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        LLM(**{"model": str(gpt2_dir), "device": "cpu", **settings})


def test_text_prompt_for_a_model_without_tokenizer_files(gpt2_dir) -> None:
    result = run_ember("generate", "--model", str(gpt2_dir), "--device", "cpu", "hello")
    assert result.returncode == 2
    assert "no tokenizer" in result.stderr.strip().splitlines()[-1]


def test_invalid_sampling_value_is_a_one_line_error(gpt2_dir) -> None:
    result = run_ember("generate", "--model", str(gpt2_dir), "--max-tokens", "-1", "hello")
    assert result.returncode == 2
    assert result.stderr.strip() == "ember: error: max_tokens must be an integer >= 0, got -1"


def test_version() -> None:
    result = run_ember("--version")
    assert result.returncode == 0 and result.stdout.strip() == "ember 0.1.0"


def test_unknown_flag_is_rejected_by_argparse() -> None:
    result = run_ember("generate", "--bogus", "x")
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


def test_invalid_setting_from_the_environment_is_a_one_line_error() -> None:
    """EMBER_* variables bypass argparse's choices; EngineConfig rejects them before any loading."""
    result = run_ember("generate", "hi", env={**os.environ, "EMBER_GGUF_WEIGHTS": "packed"})
    assert result.returncode == 2
    assert result.stderr.strip() == "ember: error: gguf_weights must be 'blocks' or 'dequantized', got 'packed'"


def test_invalid_kv_cache_dtype_is_a_one_line_error() -> None:
    result = run_ember("generate", "hi", env={**os.environ, "EMBER_KV_CACHE_DTYPE": "int4"})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ember: error: kv_cache_dtype must be one of auto, float32, float16, bfloat16, int8, fp8_e4m3, got 'int4'"
    )


def test_prefix_caching_is_on_unless_a_flag_or_the_environment_turns_it_off(monkeypatch) -> None:
    from ember_engine.cli import build_parser

    monkeypatch.delenv("EMBER_ENABLE_PREFIX_CACHING", raising=False)
    assert build_parser().parse_args([]).enable_prefix_caching is True
    assert build_parser().parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    monkeypatch.setenv("EMBER_ENABLE_PREFIX_CACHING", "false")
    assert build_parser().parse_args([]).enable_prefix_caching is False
    assert build_parser().parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True


def test_invalid_flag_value_in_the_environment_is_a_one_line_error() -> None:
    result = run_ember("generate", "hi", env={**os.environ, "EMBER_ENABLE_PREFIX_CACHING": "maybe"})
    assert result.returncode == 2
    assert result.stderr.strip() == "ember: error: EMBER_ENABLE_PREFIX_CACHING must be true or false, got 'maybe'"


@pytest.mark.parametrize(
    "command",
    [["ember_cli", "--log-level", "LOUD", "generate", "hi"], ["ember_cli", "generate", "--log-level", "LOUD", "hi"],
     ["ember_cli", "bench", "offline", "--log-level", "LOUD"], ["ember_cli", "serve", "--log-level", "LOUD"],
     ["ember_engine", "--log-level", "LOUD"], ["ember_gateway", "--log-level", "LOUD"]],
    ids=["ember", "ember generate", "ember bench offline", "ember serve", "ember-engine", "ember-gateway"],
)
def test_a_bad_log_level_is_a_usage_error_before_anything_starts(command: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", *command], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "argument --log-level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case), got 'LOUD'"
    )


def test_ember_log_level_before_serve_goes_to_serve_with_serves_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_ember("--log-level", "info", "serve", "--port", "0", "--bogus")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "ember-serve: error: unrecognized arguments: --bogus"
    parsed = []
    monkeypatch.setattr(serve, "main", lambda argv: parsed.append(serve.build_parser().parse_args(argv)))
    monkeypatch.delenv("EMBER_LOG_LEVEL", raising=False)
    cli.main(["--log-level", "debug", "serve", "--port", "0"])
    cli.main(["serve", "--port", "1"])
    assert [(args.log_level, args.port) for args in parsed] == [("DEBUG", 0), ("INFO", 1)]


def test_log_level_after_a_subcommand_or_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_LOG_LEVEL", raising=False)
    parser, _ = cli.build_parser()
    assert parser.parse_args(["generate", "--log-level", "debug", "hi"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "error", "generate", "hi"]).log_level == "ERROR"
    assert parser.parse_args(["generate", "hi"]).log_level is None  # WARNING, set by main


def test_data_parallel_engines_get_even_contiguous_shares_of_the_cores() -> None:
    from ember_cli.serve import split_cores

    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([0, 1], 3) == [[0], [1], [0]]  # more engines than cores: they share
