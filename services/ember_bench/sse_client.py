"""One streamed /v1/completions request, timed chunk by chunk. Never raises: every failure
(HTTP status, SSE error event, broken stream, connection error, timeout) becomes a failed result."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from ember_bench.stats import RequestResult

MAX_ERROR_CHARS = 200


class RequestFailed(Exception):
    pass


async def stream_completion(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> RequestResult:
    result = RequestResult()
    try:
        await asyncio.wait_for(_stream(session, url, payload, headers, result), timeout_s)
    except TimeoutError:
        where = "mid-stream" if result.ttft else "before the first token"
        result.error = f"timed out after {timeout_s:g} s {where}"
    except RequestFailed as exc:
        result.error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a server may send anything; one bad reply must not end the run
        result.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    result.success = not result.error
    return result


async def _stream(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], headers: dict[str, str], result: RequestResult
) -> None:
    """Fill result in place, so a timeout still leaves what was measured before it."""
    start = time.perf_counter()
    async with session.post(url, json=payload, headers=headers) as response:
        if response.status != 200:
            raise RequestFailed(f"HTTP {response.status}: {_error_message(await response.text())}")
        num_chunks = 0
        last_chunk_at = start
        async for data in _sse_data(response.content):
            if data == "[DONE]":
                break
            event = json.loads(data)
            if not isinstance(event, dict):
                raise RequestFailed(f"not an OpenAI stream event: {data[:MAX_ERROR_CHARS]}")
            if event.get("error"):
                raise RequestFailed(f"error event: {_error_message(event)}")
            choices = event.get("choices") or []
            text = "".join(choice.get("text") or "" for choice in choices)
            for choice in choices:  # requested with return_token_ids
                result.token_ids.extend(choice.get("token_ids") or [])
            if text:
                result.text += text
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last_chunk_at)
                last_chunk_at = now
                num_chunks += 1
            if usage := event.get("usage"):
                result.prompt_tokens = usage.get("prompt_tokens") or 0
                result.output_tokens = usage.get("completion_tokens") or 0
        else:
            raise RequestFailed(f"stream ended before [DONE] after {num_chunks} text chunks")
    if num_chunks == 0:
        raise RequestFailed("the stream held no text")
    result.latency = last_chunk_at - start
    result.output_tokens = result.output_tokens or num_chunks


async def _sse_data(stream: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The data of each server-sent event; comments, event names and ids are skipped."""
    lines: list[str] = []
    async for raw in stream:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
        elif not line and lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


def _error_message(body: str | dict[str, Any]) -> str:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return body.strip()[:MAX_ERROR_CHARS]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message).strip()[:MAX_ERROR_CHARS]
