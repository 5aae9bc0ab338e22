"""A stand-in for the server side of `bench serve`: an OpenAI-style /v1/completions that streams
SSE, or fails in one chosen way. It runs its own event loop in a thread, so tests can call the
synchronous CLI."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Literal, Self

from aiohttp import web

from tests.processes import free_port

Mode = Literal["ok", "no_usage", "http500", "stall", "error_event", "garbage"]
MODEL_ID = "fake-model"


class FakeOpenAIServer:
    def __init__(self, mode: Mode = "ok", chunk_delay_s: float = 0.005) -> None:
        self.mode = mode
        self.chunk_delay_s = chunk_delay_s
        self.url = f"http://127.0.0.1:{free_port()}"
        self.received: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._release = asyncio.Event()  # stalled handlers wait on it; set at exit so cleanup is quick

    def __enter__(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", int(self.url.rsplit(":", 1)[1])).start()

    async def _stop(self) -> None:
        self._release.set()
        await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        if self.mode == "http500":
            error = {"message": "boom", "type": "server_error", "param": None, "code": "internal_error"}
            return web.json_response({"error": error}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": keep-alive comment\n\n")
        await _send(response, _chunk(""))  # a role-only first chunk carries no text: not the first token
        for index in range(body["max_tokens"]):
            await asyncio.sleep(self.chunk_delay_s)
            await _send(response, _chunk(f" t{index}"))
            if self.mode == "stall" and index == 1:
                await self._release.wait()
                return response
            if self.mode == "error_event":
                await _send(response, {"error": {"message": "engine went away", "type": "server_error"}})
                break
            if self.mode == "garbage":
                await response.write(b"data: [1, 2]\n\n")
                break
        else:
            await _send(response, _chunk("", finish_reason="length"))
            if self.mode == "ok" and body.get("stream_options", {}).get("include_usage"):
                prompt_tokens = len(body["prompt"].split())
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"],
                         "total_tokens": prompt_tokens + body["max_tokens"]}
                await _send(response, {"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        return response


def _chunk(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": "cmpl-1", "object": "text_completion", "model": MODEL_ID, "choices": [choice], "usage": None}


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
