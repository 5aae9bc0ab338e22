"""`bench serve` against a fake streaming server: right numbers when it works, and a run that
always ends (failures counted) when it does not."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from ember_bench.serve import arrival_offsets
from tests.bench.fake_openai import MODEL_ID, FakeOpenAIServer
from tests.bench.helpers import read_json, run_bench_cli, write_workload
from tests.processes import free_port

MAX_TOKENS = [3, 5, 8, 4]


def bench_serve(url: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    workload = write_workload(tmp_path / "workload.json", MAX_TOKENS)
    out = tmp_path / "result.json"
    code = run_bench_cli("serve", "--base-url", url, "--workload", str(workload), "--output-json", str(out), *extra)
    return code, read_json(out)


def test_normal_run_counts_tokens_and_times_each_phase(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with FakeOpenAIServer("ok") as server:
        code, result = bench_serve(server.url + "/v1", tmp_path, "--concurrency", "2", "--ignore-eos",
                                   "--api-key", "sekrit")
    metrics = result["metrics"]
    assert code == 0
    assert (metrics["completed"], metrics["failed"]) == (len(MAX_TOKENS), 0)
    assert metrics["output_tokens"] == sum(MAX_TOKENS)
    assert metrics["input_tokens"] == 9 * len(MAX_TOKENS)
    assert result["config"]["model"] == MODEL_ID  # asked GET /v1/models
    assert 0 < metrics["ttft_ms"]["mean"] < metrics["e2e_ms"]["mean"]
    assert metrics["ttft_ms"]["median"] <= metrics["ttft_ms"]["p99"]
    assert metrics["tpot_ms"]["mean"] > 0 and metrics["itl_ms"]["mean"] > 0
    assert metrics["request_throughput"] > 0 and metrics["output_throughput"] > 0
    assert metrics["total_token_throughput"] > metrics["output_throughput"]
    assert metrics["goodput"] is None and metrics["errors"] == []
    sent = server.received[0]
    assert sent["model"] == MODEL_ID and sent["stream"] is True and sent["ignore_eos"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sorted(body["max_tokens"] for body in server.received) == sorted(MAX_TOKENS)
    assert server.authorizations == ["Bearer sekrit"] * len(MAX_TOKENS)
    assert "sekrit" not in (tmp_path / "result.json").read_text()
    table = capsys.readouterr().out
    assert "Completed requests" in table and "TPOT" in table


def test_without_usage_the_text_chunks_are_counted(tmp_path: Path) -> None:
    with FakeOpenAIServer("no_usage") as server:
        code, result = bench_serve(server.url, tmp_path, "--model", MODEL_ID)
    assert code == 0
    assert result["metrics"]["output_tokens"] == sum(MAX_TOKENS)


def test_goodput_counts_requests_meeting_every_slo(tmp_path: Path) -> None:
    with FakeOpenAIServer("ok") as server:
        _, generous = bench_serve(server.url, tmp_path, "--goodput", "ttft:60000", "e2e:60000")
        _, strict = bench_serve(server.url, tmp_path, "--goodput", "ttft:60000", "tpot:0.0001")
    assert generous["metrics"]["goodput"] == pytest.approx(generous["metrics"]["request_throughput"])
    assert generous["config"]["slos"] == {"ttft": 60000.0, "e2e": 60000.0}
    assert strict["metrics"]["goodput"] == 0


def test_poisson_arrivals_complete(tmp_path: Path) -> None:
    with FakeOpenAIServer("ok") as server:
        code, result = bench_serve(server.url, tmp_path, "--request-rate", "200", "--concurrency", "3",
                                   "--num-prompts", "6", "--seed", "3")
    assert code == 0
    assert result["metrics"]["completed"] == 6 and result["num_requests"] == 6
    assert result["config"]["request_rate"] == 200.0


def test_http_500_is_a_failure_with_its_message(tmp_path: Path) -> None:
    with FakeOpenAIServer("http500") as server:
        code, result = bench_serve(server.url, tmp_path, "--model", MODEL_ID)
    metrics = result["metrics"]
    assert code == 1  # nothing completed
    assert (metrics["completed"], metrics["failed"]) == (0, len(MAX_TOKENS))
    assert metrics["errors"][0] == "HTTP 500: boom"
    assert metrics["ttft_ms"] is None and metrics["output_throughput"] == 0


def test_sse_error_event_is_a_failure(tmp_path: Path) -> None:
    with FakeOpenAIServer("error_event") as server:
        _, result = bench_serve(server.url, tmp_path, "--model", MODEL_ID)
    assert result["metrics"]["failed"] == len(MAX_TOKENS)
    assert result["metrics"]["errors"][0] == "error event: engine went away"


def test_a_malformed_event_is_a_failure_not_a_crash(tmp_path: Path) -> None:
    with FakeOpenAIServer("garbage") as server:
        code, result = bench_serve(server.url, tmp_path, "--model", MODEL_ID)
    assert code == 1
    assert result["metrics"]["failed"] == len(MAX_TOKENS)
    assert result["metrics"]["errors"][0] == "not an OpenAI stream event: [1, 2]"


def test_a_server_stalling_mid_stream_fails_by_the_timeout(tmp_path: Path) -> None:
    with FakeOpenAIServer("stall") as server:
        code, result = bench_serve(server.url, tmp_path, "--model", MODEL_ID, "--timeout", "0.5")
    metrics = result["metrics"]
    assert code == 1
    assert metrics["failed"] == len(MAX_TOKENS)
    assert metrics["errors"][0] == "timed out after 0.5 s mid-stream"


def test_connection_refused_fails_every_request(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    code, result = bench_serve(url, tmp_path, "--model", MODEL_ID, "--timeout", "30")
    assert time.monotonic() - started < 20, "refused connections should fail at once, not by the timeout"
    assert code == 1
    assert result["metrics"]["failed"] == len(MAX_TOKENS)
    assert "ClientConnectorError" in result["metrics"]["errors"][0]


def test_no_model_and_no_server_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    workload = write_workload(tmp_path / "workload.json", MAX_TOKENS)
    code = run_bench_cli("serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--workload", str(workload))
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("ember bench: error: cannot get a model id from") and "\n" not in err


def test_poisson_arrival_offsets() -> None:
    offsets = arrival_offsets(2000, request_rate=50.0, seed=7)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.1)
    assert offsets == arrival_offsets(2000, 50.0, seed=7)
    assert arrival_offsets(3, None, seed=7) == [0.0, 0.0, 0.0]
