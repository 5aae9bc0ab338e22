"""What context costs one stream on a running server: the decode time per token after a short and a
long prompt, and the time to first token of a conversation's first turn and of its next turn (the
first turn's prompt and answer again, then a short question: a prefix hit where the server caches).

    ember bench context --url http://127.0.0.1:8000 [--short 100 --long 8000 --turn 2000]

Prompts are random token ids below 300 (/v1/completions accepts ids; every vocabulary has those),
so the lengths are exact whatever the tokenizer; each measurement is the median of --rounds
requests, one at a time. A hybrid model's
decode should cost the same at any context (its recurrent layers keep a fixed-size state), and its
second turn should resume from the first turn's state checkpoint.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import asdict, dataclass

import aiohttp

from ember_bench.sse_client import stream_completion
from ember_bench.stats import tpot


@dataclass(frozen=True)
class ContextCosts:
    model: str
    short_tokens: int
    long_tokens: int
    turn_tokens: int
    tpot_short_s: float
    tpot_long_s: float
    first_turn_ttft_s: float
    second_turn_ttft_s: float

    @property
    def long_over_short(self) -> float:
        return self.tpot_long_s / self.tpot_short_s

    @property
    def second_over_first(self) -> float:
        return self.second_turn_ttft_s / self.first_turn_ttft_s

    def report(self) -> str:
        return (
            f"{self.model}: TPOT {self.tpot_short_s * 1000:.1f} ms at {self.short_tokens} tokens of context, "
            f"{self.tpot_long_s * 1000:.1f} ms at {self.long_tokens} ({self.long_over_short:.2f}x); TTFT of a "
            f"{self.turn_tokens}-token first turn {self.first_turn_ttft_s:.2f} s, of its next turn "
            f"{self.second_turn_ttft_s:.2f} s ({self.second_over_first:.2f}x)"
        )

    def as_json(self) -> dict[str, object]:
        return {**asdict(self), "long_over_short": self.long_over_short, "second_over_first": self.second_over_first}


async def measure(url: str, short: int, long: int, turn: int, output: int, rounds: int, seed: int = 0) -> ContextCosts:
    """Medians over rounds, each round's prompts fresh random token ids (no prefix shared between rounds)."""
    generator = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as response:
            if response.status != 200:
                raise ValueError(f"{url}/v1/models answered {response.status}: {(await response.text())[:200]}")
            model = (await response.json())["data"][0]["id"]

        async def complete(prompt: list[int], max_tokens: int) -> tuple[float, float | None, list[int]]:
            payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "return_token_ids": True}
            result = await stream_completion(session, f"{url}/v1/completions", payload, {}, timeout_s=3600)
            if not result.success:
                raise ValueError(f"a request failed: {result.error}")
            return result.ttft, tpot(result), result.token_ids

        def tokens(count: int) -> list[int]:
            return [generator.randrange(3, 300) for _ in range(count)]

        tpots: dict[int, list[float]] = {short: [], long: []}
        first, second = [], []
        for _ in range(rounds):
            for length in (short, long):
                _, per_token, _ = await complete(tokens(length), output)
                assert per_token is not None
                tpots[length].append(per_token)
            prompt = tokens(turn)
            ttft, _, answer = await complete(prompt, output)
            first.append(ttft)
            next_ttft, _, _ = await complete(prompt + answer + tokens(16), output)  # the turn, its answer, a question
            second.append(next_ttft)
    return ContextCosts(
        model, short, long, turn, statistics.median(tpots[short]), statistics.median(tpots[long]),
        statistics.median(first), statistics.median(second),
    )


def run(url: str, short: int, long: int, turn: int, output: int, rounds: int) -> ContextCosts:
    return asyncio.run(measure(url, short, long, turn, output, rounds))
