"""Writes a benchmark workload in the shape of workloads/smollm2.json: plain English prompts, each
sentences drawn at random from SENTENCES (the ones smollm2.json is made of) and cut at exactly
`prompt_tokens` tokens of the model's tokenizer, asking for `max_tokens` tokens; both uniform in
their ranges.

    python -m ember_bench.make_workload --seed 1 > services/ember_bench/workloads/mine.json

smollm2.json reached the project without the script that made it and is kept byte for byte;
this script makes workloads of its shape, and `--check FILE` verifies a workload's prompt_tokens
against the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import gguf

from ember_core.config import DEFAULT_MODEL
from ember_core.loaders.resolve import resolve_model
from ember_core.tokenizer import Tokenizer, load_hf_tokenizer, tokenizer_from_gguf

SENTENCES = (
    "The recipe says to simmer the sauce for 45 minutes, stirring now and then so that it does not burn.",
    "The mountain hut offers bunk beds, hot soup and a view of three glaciers from the terrace.",
    "Light from the nearest star other than the Sun takes a little more than four years to reach us.",
    "Volunteers counted 312 species of plants along the trail during the summer survey.",
    "She tuned the old piano by ear, one string at a time, until the chords rang clear again.",
    "Our team meets every Monday at 9:30 to review open issues and decide what to ship that week.",
    "A cache stores recently used data close to the processor so that repeated reads are much faster.",
    "A good sourdough starter needs flour, water, patience and a kitchen that stays around 24 degrees Celsius.",
    "To reset the device, hold the power button for ten seconds and wait until the green light blinks twice.",
    "Each node in the network forwards packets to its neighbours and keeps a small table of recent routes.",
    "In the spring of 1887 the town council approved a plan to pave the main street with granite blocks.",
    "When the tide went out, the children searched the rock pools for crabs, shells and small fish.",
    "The court ruled that the contract was void because one of the parties had not signed the final page.",
    "The library's reading room has tall windows, long oak tables and a clock that chimes every hour.",
    "The expedition carried 40 kilograms of rice, 12 liters of oil and enough lamp fuel for two months.",
    "During the drought the farmers dug deeper wells and shared water according to an old agreement.",
    "The function returns early when the input list is empty, otherwise it sorts the items and removes duplicates.",
    "The museum's collection includes coins, pottery and a bronze helmet found near the river crossing.",
    "A compiler translates source code into machine instructions, checking types and optimising loops on the way.",
    "Glaciers move slowly, but over a few centuries they can carve a valley hundreds of meters deep.",
    "Bees communicate the direction of flowers through a dance that encodes angle and distance.",
    "The harbor master logged every vessel that entered the bay, noting its name, its cargo and the hour of arrival.",
    "The orchestra rehearsed the second movement slowly, then faster, until the strings and winds were in time.",
    "Migrating birds use the stars, the Earth's magnetic field and familiar landmarks to find their way.",
)


def make_workload(
    tokenizer: Tokenizer,
    *,
    count: int = 32,
    prompt_tokens: tuple[int, int] = (16, 128),
    max_tokens: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> list[dict[str, object]]:
    rng = random.Random(seed)
    return [_request(tokenizer, rng, rng.randint(*prompt_tokens), rng.randint(*max_tokens)) for _ in range(count)]


def _request(tokenizer: Tokenizer, rng: random.Random, length: int, max_tokens: int) -> dict[str, object]:
    text = ""
    while len(tokenizer.encode_prompt(text)) < length:
        text = f"{text} {rng.choice(SENTENCES)}".lstrip()
    # A cut between tokens can re-encode differently: cut shorter until the text is `length` tokens.
    for cut in range(length, 0, -1):
        prompt = tokenizer.decode(tokenizer.encode_prompt(text)[:cut])
        if len(tokenizer.encode_prompt(prompt)) == cut:
            return {"prompt": prompt, "max_tokens": max_tokens, "prompt_tokens": cut}
    raise ValueError("no cut of the sentences re-encodes to its own length")


def mismatches(tokenizer: Tokenizer, workload: list[dict[str, object]]) -> list[int]:
    """Indices of the requests whose prompt_tokens is not their prompt's length under tokenizer."""
    return [
        index for index, item in enumerate(workload)
        if len(tokenizer.encode_prompt(str(item["prompt"]))) != item.get("prompt_tokens")
    ]


def load_tokenizer(model: str) -> Tokenizer:
    path = resolve_model(model)
    tokenizer = load_hf_tokenizer(path) if path.is_dir() else tokenizer_from_gguf(gguf.GGUFReader(path))
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer")
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember_bench.make_workload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer counts the prompt tokens")
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", type=Path, help="verify this workload's prompt_tokens instead of writing one")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    if args.check is not None:
        bad = mismatches(tokenizer, json.loads(args.check.read_text()))
        print(f"{args.check}: " + (f"prompt_tokens wrong at {bad}" if bad else "every prompt_tokens matches"))
        return 1 if bad else 0
    json.dump(make_workload(tokenizer, count=args.count, seed=args.seed), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
