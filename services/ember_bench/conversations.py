"""Multi-tenant, multi-turn conversations: the workload that shows where a router sends requests.

Each tenant has a long shared context (a system prompt of ~`context_tokens` tokens); each of its
users holds a conversation of several turns, every turn's prompt the context, the turns so far
(with the model's own answers) and a new question. Users talk at once; a user's turns go one after
the other. An engine that served a conversation's last turn holds all of its next prompt but the
new question; a tenant's other users share its context.

    python -m ember_bench.conversations > services/ember_bench/workloads/conversations_smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from ember_bench.make_workload import SENTENCES, load_tokenizer
from ember_bench.serve import arrival_offsets
from ember_bench.sse_client import stream_completion
from ember_bench.stats import RequestResult
from ember_core.config import DEFAULT_MODEL
from ember_core.tokenizer import Tokenizer


class Conversation(msgspec.Struct):
    tenant: int
    questions: list[str]
    max_tokens: int


class ConversationWorkload(msgspec.Struct):
    contexts: list[str]  # one per tenant
    conversations: list[Conversation]

    def prompt(self, conversation: Conversation, answers: list[str]) -> str:
        """The prompt of the turn after these answers: context, the turns so far, the next question."""
        turns = "".join(
            f"\nUser: {question}\nAssistant:{answer}" for question, answer in zip(conversation.questions, answers)
        )
        return f"{self.contexts[conversation.tenant]}\n{turns}\nUser: {conversation.questions[len(answers)]}\nAssistant:"


def make_conversations(
    tokenizer: Tokenizer, *, tenants: int, users: int, turns: int, context_tokens: int, max_tokens: int, seed: int = 0
) -> ConversationWorkload:
    rng = random.Random(seed)
    contexts = []
    for tenant in range(tenants):
        text = f"You are the assistant of tenant {tenant}. Answer from these notes."
        while len(tokenizer.encode_prompt(text)) < context_tokens:
            text += " " + rng.choice(SENTENCES)
        contexts.append(text)
    conversations = [
        Conversation(tenant, [f"What does this say: {rng.choice(SENTENCES)}" for _ in range(turns)], max_tokens)
        for tenant in range(tenants)
        for _ in range(users)
    ]
    rng.shuffle(conversations)
    return ConversationWorkload(contexts, conversations)


def load_conversations(path: str | Path) -> ConversationWorkload:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=ConversationWorkload)
    except OSError as exc:
        raise ValueError(f"cannot read conversations {path}: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not a conversation workload: {exc}") from None


@dataclass
class TurnResult:
    conversation: int
    turn: int
    result: RequestResult = field(default_factory=RequestResult)


async def run_conversations(
    url: str,
    model: str,
    workload: ConversationWorkload,
    timeout_s: float,
    concurrency: int | None = None,
    user_rate: float | None = None,
    seed: int = 0,
) -> list[TurnResult]:
    """The conversations, started all at once or as users arriving at user_rate per second (a
    Poisson process), at most `concurrency` turns in flight; each turn streamed and greedy, the
    answer appended to the conversation. A failed turn ends its conversation."""
    limiter = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    connector = aiohttp.TCPConnector(limit=0)
    offsets = arrival_offsets(len(workload.conversations), user_rate, seed)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def talk(index: int, conversation: Conversation) -> list[TurnResult]:
            await asyncio.sleep(offsets[index])
            answers: list[str] = []
            results = []
            for turn in range(len(conversation.questions)):
                payload = _payload(model, workload.prompt(conversation, answers), conversation.max_tokens)
                async with limiter:
                    result = await stream_completion(session, f"{url}/v1/completions", payload, {}, timeout_s)
                results.append(TurnResult(index, turn, result))
                if not result.success:
                    break
                answers.append(result.text)
            return results

        talks = [talk(index, conversation) for index, conversation in enumerate(workload.conversations)]
        return [turn for turns in await asyncio.gather(*talks) for turn in turns]


def _payload(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember_bench.conversations", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer counts the context tokens")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--users", type=int, default=4, help="conversations per tenant")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32, help="of each answer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    workload = make_conversations(
        load_tokenizer(args.model), tenants=args.tenants, users=args.users, turns=args.turns,
        context_tokens=args.context_tokens, max_tokens=args.max_tokens, seed=args.seed,
    )
    json.dump(msgspec.to_builtins(workload), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
