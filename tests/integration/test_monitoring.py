"""The monitoring profile (deploy/monitoring): every query of the Grafana dashboard names only
metrics that a live `ember serve` exports, reads engine-wide values once per engine however many
gateways report them, parses as PromQL, and answers series from a real Prometheus scraping that
gateway; the Prometheus config passes promtool; the compose profile validates.

The model served is a random mixture of experts, so that `ember_moe_expert_tokens_total` (sent only
by a MoE model) is on /metrics too; the spec-decode counters are exported, at 0, without
speculative decoding. `ember_num_preemptions_by_priority_total` appears only after a preemption
and is left off the dashboard (`ember_num_preemptions_total` counts the same preemptions)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_deploy import needs_compose
from tests.processes import free_port, http_status, served, stop_process, wait_until

pytest.importorskip("transformers")
from ember_bench.random_models import random_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "ember-dashboard.json"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    None in (PROMETHEUS, PROMTOOL), reason="prometheus / promtool not installed (make test installs them as root)"
)
# The pools' sizes, blocks and slots are fixed for an engine's life: /metrics and the live dashboard show them.
NOT_ON_DASHBOARD = {
    "ember_num_preemptions_by_priority_total", "ember_kv_cache_bytes", "ember_kv_cache_blocks", "ember_state_pool_bytes",
    "ember_state_slots",
}
# A histogram's series; `_created` series are prometheus_client's start times, not shown.
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")
# What a tokenizer must skip to find metric names: strings, label matchers, ranges, label lists.
_NOT_NAMES = re.compile(
    r'"(?:[^"\\]|\\.)*"|\{[^}]*\}|\[[^\]]*\]|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)'
)
_IDENTIFIER = re.compile(r"(?<![\w:$])[A-Za-z_:][\w:]*(?![\w:])(?!\s*\()")  # a name not called as a function
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_MAX_BY = re.compile(r"\bmax by \(([^)]*)\)\s*\(")


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def metric_names(expr: str) -> dict[str, list[int]]:
    """The metric names a PromQL expression selects, each with its offsets in the expression."""
    blanked = _NOT_NAMES.sub(lambda m: " " * len(m.group()), expr)
    names: dict[str, list[int]] = {}
    for match in _IDENTIFIER.finditer(blanked):
        if match.group().lower() not in _KEYWORDS:
            names.setdefault(match.group(), []).append(match.start())
    return names


def per_engine_spans(expr: str) -> list[range]:
    """The arguments of every `max by (..., engine, ...) (...)` in the expression, as offset ranges."""
    spans = []
    for match in _MAX_BY.finditer(expr):
        if "engine" not in {label.strip() for label in match.group(1).split(",")}:
            continue
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            end += 1
        spans.append(range(match.end(), end - 1))
    return spans


def family(sample_name: str) -> str:
    return HISTOGRAM_SERIES.sub("", sample_name)


def test_the_tokenizer_finds_names_and_skips_labels_ranges_and_functions() -> None:
    expr = ('histogram_quantile(0.9, sum by (le) (rate(a_bucket{model_name=~"$m",x="b_c"}[$__rate_interval])))'
            " / on(engine) max by (engine) (b:c offset 5m) > bool 1e3")
    assert metric_names(expr) == {"a_bucket": [42], "b:c": [128]}
    assert [expr[span.start:span.stop] for span in per_engine_spans(expr)] == ["b:c offset 5m"]


def scrape(base: str) -> dict[str, set[str]]:
    """A gateway's /metrics: each sample name with its label names."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {sample.name: set(sample.labels) for metrics in text_string_to_metric_families(text)
            for sample in metrics.samples}


def with_grafana_variables(expr: str, rate_interval: str) -> str:
    expr = expr.replace("$__rate_interval", rate_interval).replace("$model_name", ".*")
    assert "$" not in expr, expr
    return expr


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live `ember serve` after a streamed and a whole completion, its expert load reported."""
    model_dir = random_checkpoint("qwen3_moe", tmp_path_factory.mktemp("monitoring") / "model", num_hidden_layers=2,
                                  num_experts=4, num_experts_per_tok=2)
    with served(model_dir, model_dir.parent / "serve.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for stream in (True, False):
            response = client.completions.create(model=model, prompt="Tell me a story", max_tokens=6, stream=stream)
            if stream:
                assert len(list(response)) > 1
        with pytest.raises(openai.BadRequestError):  # ember_request_errors_total{status="400"}
            client.completions.create(model=model, prompt="Tell me a story", max_tokens=-1)
        # The expert load rides on the engine's messages at most once a second.
        wait_until(lambda: "ember_moe_expert_tokens_total" in scrape(base), 10, "the expert load on /metrics")
        yield base


@pytest.fixture(scope="module")
def exported(gateway: str) -> dict[str, set[str]]:
    return scrape(gateway)


def test_every_dashboard_query_names_only_exported_metrics(exported: dict[str, set[str]]) -> None:
    for expr in dashboard_queries():
        names = metric_names(expr)
        assert names, expr
        assert set(names) <= set(exported), f"{expr}: {sorted(set(names) - set(exported))} not on /metrics"


def test_the_dashboard_shows_every_exported_family(exported: dict[str, set[str]]) -> None:
    shown = {family(name) for expr in dashboard_queries() for name in metric_names(expr)}
    missing = {family(name) for name in exported if name.startswith("ember_") and not name.endswith("_created")}
    missing -= shown
    assert missing <= NOT_ON_DASHBOARD


def test_engine_wide_values_are_taken_once_per_engine(exported: dict[str, set[str]]) -> None:
    """Every gateway reports every engine's values: summing them over gateways would count each
    engine once per gateway, so each such selector sits inside a `max by (engine ...)`."""
    engine_wide = {name for name, labels in exported.items() if "engine" in labels}
    assert {"ember_kv_cache_usage_perc", "ember_num_requests_running", "ember_prefix_cache_hits_total"} <= engine_wide
    for expr in dashboard_queries():
        spans = per_engine_spans(expr)
        for name, offsets in metric_names(expr).items():
            if name in engine_wide:
                assert all(any(offset in span for span in spans) for offset in offsets), f"{name} in {expr}"


@needs_prometheus
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule, with Grafana's variables given values."""
    rules = [{"record": f"dashboard:query_{index}", "expr": with_grafana_variables(expr, "1m")}
             for index, expr in enumerate(dashboard_queries())]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_prometheus
def test_every_dashboard_query_returns_series_from_a_real_prometheus(gateway: str, tmp_path: Path) -> None:
    """Prometheus scrapes the live gateway every second, and each query, with a 5 s rate window,
    answers at least one series."""
    config = {"scrape_configs": [{"job_name": "ember-gateway", "scrape_interval": "1s",
                                  "static_configs": [{"targets": [gateway.removeprefix("http://")]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    argv = [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}"]
    with open(tmp_path / "prometheus.log", "wb") as log:
        prometheus = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: prometheus.poll() is not None or http_status(f"{url}/-/ready") == 200, 30, "prometheus")
        assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()

        def series(expr: str) -> list[dict]:
            query = urllib.parse.urlencode({"query": with_grafana_variables(expr, "5s")})
            with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=5) as response:
                return json.load(response)["data"]["result"]

        for expr in dashboard_queries():
            wait_until(lambda query=expr: bool(series(query)), 30, f"a series from {expr}", interval=0.5)
    finally:
        stop_process(prometheus)


@needs_prometheus
def test_prometheus_config_is_valid() -> None:
    result = subprocess.run([PROMTOOL, "check", "config", str(MONITORING / "prometheus.yml")],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_gateways_metrics_port() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    (job,) = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
    (discovery,) = job["dns_sd_configs"]
    assert discovery["names"] == ["gateway"] and job["metrics_path"] == "/metrics"
    assert [str(discovery["port"])] == compose["services"]["gateway"]["expose"]


@needs_compose
def test_compose_monitoring_profile_is_valid_and_adds_only_its_services() -> None:
    result = subprocess.run(["docker-compose", "--profile", "monitoring", "config"], cwd=ROOT, capture_output=True,
                            check=False, text=True)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert {name for name, service in services.items() if service.get("profiles") == ["monitoring"]} == {
        "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert not source.startswith("./") or (ROOT / source).exists(), f"{name}: {source}"
