"""The HTTP edge against raw sockets, as an adversarial client meets it: slow headers, slow bodies
and idle connections closed by their timeouts, a cap on connections, declared bodies refused before
they are read, half-closed clients answered, and bodies that are not JSON refused with one clear error."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest

from tests.gateway.api.test_validation import assert_openai_error
from tests.gateway.conftest import StartGateway, wait_until_async
from tests.gateway.fake_engine import FakeEngine

LIMITS = {"header_timeout": 1.0, "body_timeout": 1.0, "keepalive_timeout": 1.5}
BODY = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 3}).encode()


def head(path: str = "/v1/completions", content_length: int = len(BODY), content_type: str = "application/json",
         **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Type: {content_type}", f"Content-Length: {content_length}",
             *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection, which must be within seconds."""
    return await asyncio.wait_for(reader.read(), seconds)


def status_and_body(response: bytes) -> tuple[int, bytes]:
    status_line, _, rest = response.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in headers.lower():
        body = _unchunk(body)
    return int(status_line.split()[1]), body


def _unchunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        out, body = out + body[:n], body[n + 2 :]
    return out


async def test_slow_headers_and_idle_connections_are_closed_by_their_timeouts(fake_engine: FakeEngine,
                                                                              start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, **LIMITS)
    started = time.monotonic()
    slowloris, slow_writer = await connect(gateway.url)
    idle, _ = await connect(gateway.url)

    async def trickle() -> None:
        for byte in head():
            slow_writer.write(bytes([byte]))
            await asyncio.sleep(0.1)

    trickling = asyncio.create_task(trickle())
    assert await closed_within(slowloris, 3.0) == b""  # the header deadline, though bytes keep coming
    assert 0.9 < time.monotonic() - started < 2.5
    trickling.cancel()
    assert await closed_within(idle, 3.0) == b""  # the keep-alive deadline
    # a connection that served a request is closed once idle for the keep-alive timeout
    reader, writer = await connect(gateway.url)
    writer.write(head() + BODY)
    response = await closed_within(reader, 4.0)
    assert status_and_body(response)[0] == 200


async def test_a_generating_stream_outlives_every_timeout(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, **LIMITS)
    fake_engine.step_interval = 0.1  # 40 tokens: 4 s, past the header and keep-alive deadlines
    events = await gateway.stream("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 40,
                                                      "stream": True})
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


async def test_a_stalled_body_gets_408_and_a_declared_oversize_body_413_unread(fake_engine: FakeEngine,
                                                                             start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, max_body_bytes=4096, **LIMITS)
    reader, writer = await connect(gateway.url)
    writer.write(head() + BODY[:10])
    status, body = status_and_body(await closed_within(reader, 5.0))
    assert assert_openai_error(status, json.loads(body), 408)["code"] == "request_timeout"
    reader, writer = await connect(gateway.url)
    writer.write(head(content_length=10_000_000))  # no Expect: 100-continue, and no body byte sent
    status, body = status_and_body(await asyncio.wait_for(reader.readuntil(b"}}"), 1.0))
    assert assert_openai_error(status, json.loads(body), 413)["code"] == "request_too_large"


async def test_connections_past_the_cap_get_503_at_accept(fake_engine: FakeEngine, start_gateway: StartGateway):
    gateway = await start_gateway(fake_engine, max_connections=2, **LIMITS)
    held = [await connect(gateway.url) for _ in range(2)]
    await asyncio.sleep(0.1)
    reader, _ = await connect(gateway.url)
    status, body = status_and_body(await closed_within(reader, 2.0))
    assert assert_openai_error(status, json.loads(body), 503)["code"] == "too_many_connections"
    for _, writer in held:
        writer.close()
    await asyncio.sleep(0.1)
    status, _ = await gateway.post("/v1/completions", json.loads(BODY))
    assert status == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_half_closes_after_its_request_gets_the_answer(fake_engine: FakeEngine,
                                                                          start_gateway: StartGateway, stream: bool):
    gateway = await start_gateway(fake_engine, **LIMITS)
    fake_engine.step_interval = 0.3  # the answer takes longer than a heartbeat
    body = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 5, "stream": stream}).encode()
    host, port = gateway.url.removeprefix("http://").split(":")

    def exchange() -> bytes:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head(content_length=len(body)) + body)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(10)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)

    status, answer = status_and_body(await asyncio.to_thread(exchange))
    assert status == 200
    if stream:
        assert answer.rstrip().endswith(b"data: [DONE]")
    else:
        assert json.loads(answer)["choices"][0]["text"] == "Hello"


async def test_bodies_that_are_not_json_get_one_clear_error(fake_engine: FakeEngine, start_gateway: StartGateway,
                                                            caplog: pytest.LogCaptureFixture):
    gateway = await start_gateway(fake_engine, **LIMITS)
    async with gateway.http.post("/v1/completions", data=BODY, headers={"Content-Type": "text/plain"}) as response:
        error = assert_openai_error(response.status, await response.json(), 415)
    assert "application/json" in error["message"]
    surrogate = b'{"model": "fake-model", "prompt": "ab\\ud800cd"}'
    async with gateway.http.post("/v1/completions", data=surrogate, headers={"Content-Type": "application/json"}) as r:
        assert "lone UTF-16 surrogate \\ud800" in assert_openai_error(r.status, await r.json(), 400)["message"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        for _ in range(5):
            reader, writer = await connect(gateway.url)
            garbage = b"\x1f\x8b not gzip at all" * 20
            writer.write(head(content_length=len(garbage), Content_Encoding="gzip") + garbage)
            status, body = status_and_body(await closed_within(reader, 3.0))  # the 400, then a clean close
            assert "could not be decoded" in assert_openai_error(status, json.loads(body), 400)["message"]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert len([r for r in caplog.records if "could not be decoded" in r.getMessage()]) == 5  # one line each


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_closes_before_any_output_is_aborted_at_once(fake_engine: FakeEngine,
                                                                          start_gateway: StartGateway, stream: bool):
    gateway = await start_gateway(fake_engine, **LIMITS)
    fake_engine.step_interval = 10.0  # no token for 10 s
    body = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 5, "stream": stream}).encode()
    _, writer = await connect(gateway.url)
    writer.write(head(content_length=len(body)) + body)
    await wait_until_async(lambda: fake_engine.num_running == 1, 5.0, "the request running")
    writer.close()  # a close looks like a half-close until the server writes: then it is a reset
    request_id = fake_engine.received[-1].request_id
    await wait_until_async(lambda: request_id in fake_engine.aborted, 2.0, "the Abort after the close")


@pytest.mark.parametrize(
    "request_bytes",
    [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n"],
    ids=["request line", "header too long", "bad content length"],
)
async def test_a_request_aiohttp_cannot_parse_gets_an_openai_error(fake_engine: FakeEngine, start_gateway: StartGateway,
                                                                    request_bytes: bytes):
    gateway = await start_gateway(fake_engine, **LIMITS)
    reader, writer = await connect(gateway.url)
    writer.write(request_bytes)
    status, body = status_and_body(await closed_within(reader, 3.0))
    assert 400 <= status < 500 and "malformed HTTP request" in assert_openai_error(status, json.loads(body), status)["message"]
