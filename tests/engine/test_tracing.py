"""The engine's spans (EngineTracer) from a real worker, caught by OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ember_core import LLM
from ember_engine.tracing import EngineTracer
from ember_engine.worker import EngineWorker, WorkerOptions
from ember_proto import Generate, SamplingOptions
from tests.engine.test_worker import Client
from tests.processes import free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def traced(gpt2_dir) -> Iterator[tuple[Client, InMemorySpanExporter]]:
    """A worker with a pool of 256 tokens, whose steps take prompts in chunks of at most 130 tokens,
    its spans in memory; and a gateway's client."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = LLM(str(gpt2_dir), device="cpu", dtype="float32", num_blocks=64, block_size=4,
                 max_num_batched_tokens=130).engine
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = EngineWorker(engine, "tiny", WorkerOptions(address), EngineTracer(provider))
    thread = threading.Thread(target=worker.run)
    thread.start()
    context = zmq.Context()
    try:
        yield Client(context, address), exporter
    finally:
        worker.request_shutdown()
        thread.join(timeout=30)
        context.destroy(linger=0)
    assert not thread.is_alive()


def _by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((span for span in spans if span.name == name), key=lambda span: span.start_time)


def test_a_request_has_its_queue_prefill_chunks_and_decode_under_the_gateways_span(traced) -> None:
    client, exporter = traced
    prompt = list(range(1, 201))  # two chunks: 130 tokens, then 70
    client.send(Generate("chunked", prompt, SamplingOptions(max_tokens=5, temperature=0.5, top_p=0.9, ignore_eos=True),
                         time.time(), traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01"))
    client.collect({"chunked"})
    spans = exporter.get_finished_spans()
    [request] = _by_name(spans, "engine request")
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(request.parent.span_id, "016x") == PARENT_ID
    assert dict(request.attributes) | {"gen_ai.latency.time_in_queue": 0} == {
        "gen_ai.request.id": "chunked",
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.usage.prompt_tokens": 200,
        "gen_ai.usage.completion_tokens": 5,
        "gen_ai.latency.time_in_queue": 0,
        "gen_ai.latency.time_in_model_prefill": pytest.approx(
            sum(s.end_time - s.start_time for s in _by_name(spans, "prefill")) / 1e9),
        "gen_ai.latency.time_in_model_decode": pytest.approx(
            sum(s.end_time - s.start_time for s in _by_name(spans, "decode")) / 1e9),
        "ember.finish_reason": "length",
        "ember.preemptions": 0,
    }
    children = [span for span in spans if span is not request]
    assert all(span.parent.span_id == request.context.span_id for span in children)
    assert [span.name for span in sorted(children, key=lambda span: span.start_time)] == ["queue", "prefill", "prefill", "decode"]
    assert [span.attributes["ember.tokens"] for span in _by_name(spans, "prefill")] == [130, 70]
    ordered = sorted(children, key=lambda span: span.start_time)
    for earlier, later in itertools.pairwise(ordered):
        assert earlier.end_time <= later.start_time  # one after the other
    assert request.start_time <= ordered[0].start_time and ordered[-1].end_time <= request.end_time


def test_a_preempted_request_has_its_wait_and_its_prompt_again(traced) -> None:
    client, exporter = traced
    # Four sequences growing to 21 blocks each (no prefix shared) cannot all stay in a pool of 64: the
    # youngest is preempted.
    ids = {f"r{index}" for index in range(4)}
    for index, request_id in enumerate(sorted(ids)):
        client.generate(request_id, list(range(index + 1, index + 41)), max_tokens=44, temperature=0, ignore_eos=True)
    client.collect(ids)
    spans = exporter.get_finished_spans()
    requests = {span.attributes["gen_ai.request.id"]: span for span in _by_name(spans, "engine request")}
    assert set(requests) == ids
    preempted = [r for r, span in requests.items() if span.attributes["ember.preemptions"]]
    assert preempted, "no request was preempted"
    request = requests[preempted[0]]
    assert request.parent is None  # no traceparent: a trace of its own
    children = sorted((s for s in spans if s.parent and s.parent.span_id == request.context.span_id),
                      key=lambda span: span.start_time)
    names = [span.name for span in children]
    assert names[:2] == ["queue", "prefill"] and "preempted" in names
    after = names[names.index("preempted") + 1:]
    assert after[0] == "prefill", names  # the prompt and the tokens so far, computed again
    assert request.attributes["gen_ai.usage.completion_tokens"] == 44


def test_an_endpoint_that_is_no_url_stops_the_engine_before_it_loads_a_model() -> None:
    result = subprocess.run([sys.executable, "-m", "ember_engine", "--model", "/no/such/model", "--otlp-traces-endpoint",
                             "collector:4318"], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ember-engine: error: otlp_traces_endpoint must be an http:// or https:// URL, got 'collector:4318'"
    )
