"""Through HTTP: 4 streams (33-token prompts, max_tokens 300, ignore_eos); after 4 s a 4,876-token
prompt arrives. Prints the long request's TTFT and each stream's largest gap between chunks:
`python docs/results/serve_long_prompt_gaps.py http://127.0.0.1:PORT` against `ember serve --dtype float32`."""

import asyncio
import itertools
import json
import sys
import time

import aiohttp

URL = sys.argv[1].rstrip("/") + "/v1/completions"
MODEL = "smollm2-135m-instruct"
PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence, "
    "thinking about the harvest, the weather, and the long winter that is surely coming to the valley. "
)
STORY = "Once upon a time in a small village by the sea there lived an old fisherman who every morning went out in his little boat to catch fish for"


async def chunk_times(session: aiohttp.ClientSession, body: dict, started: float) -> list[float]:
    times = []
    async with session.post(URL, json={"model": MODEL, "temperature": 0, "stream": True, **body}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                assert "error" not in json.loads(line[6:]), line
                times.append(time.monotonic() - started)
    return times


async def long_request(session: aiohttp.ClientSession, started: float) -> tuple[float, list[float]]:
    await asyncio.sleep(4)
    sent = time.monotonic() - started
    return sent, await chunk_times(session, {"prompt": PARAGRAPH * 125, "max_tokens": 8}, started)


async def main() -> None:
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        streams = [chunk_times(session, {"prompt": f"Story {i}: {STORY}", "max_tokens": 300, "ignore_eos": True}, started) for i in range(4)]
        *stream_times, (sent, long_times) = await asyncio.gather(*streams, long_request(session, started))
    print(f"long request: TTFT {long_times[0] - sent:.2f} s")
    for i, times in enumerate(stream_times):
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        print(f"stream {i}: {len(times)} chunks, largest gap {max(gaps):.2f} s, median {sorted(gaps)[len(gaps) // 2]:.3f} s, done at {times[-1]:.1f} s")


asyncio.run(main())
