"""The gateway's spans, caught by OpenTelemetry's in-memory exporter, and its Generates' trace context."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ember_gateway.config import GatewayConfig
from ember_gateway.edge.errors import engine_unavailable
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_engine import FakeEngine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0.5}


@pytest.fixture
async def traced(fake_engine: FakeEngine, start_gateway: StartGateway) -> tuple[Gateway, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return await start_gateway(fake_engine, tracer_provider=provider), exporter


def _hex(number: int, digits: int) -> str:
    return format(number, f"0{digits}x")


async def test_a_stream_is_one_span_with_its_steps_under_the_callers_traceparent(traced, fake_engine: FakeEngine):
    gateway, exporter = traced
    events = await gateway.stream("/v1/chat/completions", CHAT | {"stream": True},
                                  headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert events[-1] == "[DONE]"
    spans = exporter.get_finished_spans()
    [root] = [span for span in spans if span.parent is None or _hex(span.parent.span_id, 16) == PARENT_ID]
    assert root.name == "POST /v1/chat/completions"
    assert (_hex(root.context.trace_id, 32), _hex(root.parent.span_id, 16)) == (TRACE_ID, PARENT_ID)
    assert root.attributes["http.response.status_code"] == 200
    steps = sorted((span for span in spans if span is not root), key=lambda span: span.start_time)
    assert [span.name for span in steps] == ["validate", "tokenize", "generate"]
    assert all(span.parent.span_id == root.context.span_id for span in steps)
    for earlier, later in itertools.pairwise(steps):
        assert earlier.end_time <= later.start_time
    assert root.start_time <= steps[0].start_time and steps[-1].end_time <= root.end_time
    generate = steps[-1]
    received = fake_engine.received[-1]
    assert dict(generate.attributes) | {"gen_ai.latency.time_to_first_token": 0} == {
        "gen_ai.request.id": received.request_id.rpartition("-")[0],
        "gen_ai.request.model": "fake-model",
        "gen_ai.request.n": 1,
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 1.0,
        "gen_ai.usage.prompt_tokens": len(received.prompt_token_ids),
        "gen_ai.usage.completion_tokens": 5,
        "gen_ai.latency.time_to_first_token": 0,
        "ember.engine": fake_engine.address,
        "ember.routing.reason": "only",
    }
    assert 0 < generate.attributes["gen_ai.latency.time_to_first_token"] < (root.end_time - root.start_time) / 1e9
    assert [event.name for event in generate.events] == ["first token"]
    # the engine's spans are the generate span's children
    assert received.traceparent == f"00-{TRACE_ID}-{_hex(generate.context.span_id, 16)}-01"


async def test_a_request_without_traceparent_starts_a_trace_and_an_invalid_one_too(traced, fake_engine: FakeEngine):
    gateway, exporter = traced
    for headers in ({}, {"traceparent": "00-not-a-trace-01"}):
        status, _ = await gateway.post("/v1/completions", {"model": "fake-model", "prompt": "Hi", "max_tokens": 2},
                                       headers=headers)
        assert status == 200
    roots = [span for span in exporter.get_finished_spans() if span.parent is None]
    assert [span.name for span in roots] == ["POST /v1/completions"] * 2
    assert roots[0].context.trace_id != roots[1].context.trace_id
    generates = [span for span in exporter.get_finished_spans() if span.name == "generate"]
    assert [r.traceparent for r in fake_engine.received] == [
        f"00-{_hex(span.context.trace_id, 32)}-{_hex(span.context.span_id, 16)}-{_hex(span.context.trace_flags, 2)}"
        for span in generates
    ]


async def test_a_refused_request_is_traced_with_its_status_and_no_engine_request(traced, fake_engine: FakeEngine):
    gateway, exporter = traced
    status, body = await gateway.post("/v1/chat/completions", CHAT | {"max_tokens": -1})
    assert (status, body["error"]["param"]) == (400, "max_tokens")
    [root] = exporter.get_finished_spans()
    assert (root.name, root.attributes["http.response.status_code"]) == ("POST /v1/chat/completions", 400)
    assert fake_engine.received == []


async def test_probes_and_scrapes_are_not_traced(traced):
    gateway, exporter = traced
    async with gateway.http.get("/health") as response:
        assert response.status == 200
    async with gateway.http.get("/metrics") as response:
        assert response.status == 200
    assert exporter.get_finished_spans() == ()


async def test_untraced_generates_carry_no_trace_context(gateway: Gateway, fake_engine: FakeEngine):
    status, _ = await gateway.post("/v1/chat/completions", CHAT, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert status == 200
    assert fake_engine.received[-1].traceparent is None


def test_with_tracing_off_no_opentelemetry_module_is_loaded():
    code = (
        "import sys\n"
        "from ember_gateway.app import create_app\n"
        "from ember_gateway.config import GatewayConfig\n"
        "import ember_cli.serve, ember_engine.cli, ember_engine.worker\n"
        "create_app(GatewayConfig(engine_addresses=('tcp://127.0.0.1:1',)))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("endpoint", ["collector:4318", "ftp://collector/v1/traces", "http://"])
def test_an_endpoint_that_is_no_http_url_is_refused(endpoint: str):
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        GatewayConfig(engine_addresses=("tcp://127.0.0.1:1",), otlp_traces_endpoint=endpoint)


def test_an_endpoint_without_a_path_posts_to_v1_traces():
    from ember_core.tracing import traces_url

    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://example.com/otlp/v1/traces") == "https://example.com/otlp/v1/traces"



async def test_a_submission_that_fails_still_ends_its_generate_span(traced, monkeypatch):
    """The engine gone between validation and submission (a race, played here by the pool refusing)."""
    gateway, exporter = traced

    def refuse(*_: object) -> None:
        raise engine_unavailable()

    monkeypatch.setattr(gateway.pool, "submit", refuse)
    status, _ = await gateway.post("/v1/chat/completions", CHAT)
    assert status == 503
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "validate", "tokenize", "generate"}
    assert spans["POST /v1/chat/completions"].attributes["http.response.status_code"] == 503
