"""`Expect: 100-continue` over a raw socket: a request the gateway would refuse gets its error before
the client uploads the body; one it accepts gets `100 Continue`, then its response."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

from tests.gateway.api.test_validation import assert_openai_error
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.test_gateway import completion


async def _send_head(gateway: Gateway, headers: dict[str, str]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    address = urlsplit(gateway.url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    lines = ["POST /v1/completions HTTP/1.1", "Host: test", "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    await writer.drain()
    return reader, writer


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
    status_line, *header_lines = head.strip().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 5)
    return int(status_line.split()[1]), headers, json.loads(body) if body else None


async def test_an_accepted_request_gets_100_continue_then_its_response(gateway: Gateway) -> None:
    body = json.dumps(completion(max_tokens=3)).encode()
    reader, writer = await _send_head(gateway, {"Content-Length": str(len(body)), "Expect": "100-continue"})
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    status, _, response = await _read_response(reader)
    assert status == 200 and response["choices"][0]["finish_reason"] == "length"
    writer.close()


async def test_an_oversized_or_unauthorised_body_is_refused_before_it_is_sent(fake_engine: FakeEngine, start_gateway: StartGateway) -> None:
    gateway = await start_gateway(fake_engine, max_body_bytes=4096, api_key="secret")
    key = {"Authorization": "Bearer secret"}
    cases = [
        ({**key, "Content-Length": "5000000"}, 413),
        ({"Content-Length": "10"}, 401),
        ({**key, "Content-Length": "10", "Expect": "something-else"}, 417),
    ]
    for headers, expected_status in cases:
        reader, writer = await _send_head(gateway, {"Expect": "100-continue", **headers})
        status, response_headers, body = await _read_response(reader)  # no body was sent
        assert_openai_error(status, body, expected_status)
        assert response_headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and the gateway closed the connection
        writer.close()
