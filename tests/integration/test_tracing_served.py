"""`ember serve --data-parallel-size 2 --otlp-traces-endpoint` against an OTLP receiver: a request
sent with a traceparent header arrives as one trace, the gateway's and the engine's spans in it."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from ember_bench.local_server import engines_ready
from tests.integration.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver
from tests.processes import served, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _post(url: str, body: dict, headers: dict[str, str]) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return response.read()


def _trace(receiver: OtlpReceiver) -> list[ReceivedSpan]:
    return [span for span in receiver.received() if span.trace_id == TRACE_ID]


def test_a_request_is_one_trace_across_gateway_and_engine(model_dir: Path) -> None:
    with otlp_receiver() as receiver:
        log = model_dir.parent / "traced-serve.log"
        with served(model_dir, log, "--data-parallel-size", "2", "--otlp-traces-endpoint", receiver.url,
                    "--num-blocks", "64", "--block-size", "4") as base:
            # /health is 200 once one engine is ready; the router chooses only once both are
            wait_until(lambda: engines_ready(base) == 2, 60, "both engines")
            stream = _post(f"{base}/v1/chat/completions", {
                "model": str(model_dir), "messages": [{"role": "user", "content": "Hello there"}],
                "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            }, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            assert stream.rstrip().endswith(b"data: [DONE]")
            # spans are exported in batches, every few seconds
            wait_until(lambda: any(s.span.name == "engine request" for s in _trace(receiver)), 30, "the engine's spans")
            wait_until(lambda: any(s.span.name.startswith("POST") for s in _trace(receiver)), 30, "the gateway's spans")
    spans = {span.span.name: span for span in _trace(receiver)}
    root, generate, request = spans["POST /v1/chat/completions"], spans["generate"], spans["engine request"]
    assert root.service == generate.service == "ember-gateway" and request.service == "ember-engine"
    assert root.parent_id == PARENT_ID  # the caller's span
    assert spans["validate"].parent_id == spans["tokenize"].parent_id == generate.parent_id == root.span_id
    assert request.parent_id == generate.span_id  # across the wire
    assert {spans[name].parent_id for name in ("queue", "prefill", "decode")} == {request.span_id}
    assert generate.attribute("ember.routing.reason") in ("prefix", "load", "idle")  # two engines: the router chose
    assert generate.attribute("ember.engine").startswith("ipc://")
    assert request.attribute("gen_ai.usage.completion_tokens") == generate.attribute("gen_ai.usage.completion_tokens") == 6
    assert request.attribute("gen_ai.usage.prompt_tokens") == generate.attribute("gen_ai.usage.prompt_tokens")
