"""A minimal OpenTelemetry collector for tests: OTLP/HTTP protobuf `POST /v1/traces` on loopback,
the spans decoded with opentelemetry-proto and kept with their service's name."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass
class ReceivedSpan:
    service: str
    span: Span

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    def attribute(self, key: str) -> object:
        for attribute in self.span.attributes:
            if attribute.key == key:
                value = attribute.value
                return getattr(value, value.WhichOneof("value"))
        raise KeyError(key)


@dataclass
class OtlpReceiver:
    url: str  # the base address, as --otlp-traces-endpoint takes it
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    receiver = OtlpReceiver(f"http://127.0.0.1:{server.server_address[1]}")
    server.receiver = receiver  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_error(404)
            return
        request = ExportTraceServiceRequest.FromString(body)
        receiver: OtlpReceiver = self.server.receiver  # type: ignore[attr-defined]
        with receiver.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
                for scope_spans in resource_spans.scope_spans:
                    receiver.spans.extend(ReceivedSpan(service, span) for span in scope_spans.spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:
        """No line per request on stderr."""
