"""Cross-check the GGUF exporter against llama.cpp: for each family and RoPE scaling, a tiny random
checkpoint is exported, served by llama.cpp's llama-server, and must continue token-id prompts with the same
greedy tokens as transformers in float32 and tokenize texts as the checkpoint's tokenizer does.
Needs a llama-server binary, so it is a script, not a test:

    python -m ember_bench.llama_cpp_check --llama-server PATH/llama-server [--checks qwen2,gemma3]

Where the two first differ, llama.cpp must have taken transformers' runner-up within a top-2
logit margin of TIE_MARGIN (a float tie: from there on the continuations legitimately differ);
anything else is a disagreement and is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ember_bench.families import FAMILIES
from ember_bench.gguf_export import FILE_TYPES, export_gguf
from ember_bench.llama_server import LlamaServer
from ember_bench.random_models import random_checkpoint


@dataclass(frozen=True)
class Check:
    family: str
    overrides: dict[str, Any] = field(default_factory=dict)


_WINDOW = {"sliding_window": 8}  # shorter than prompt + output: sliding-window attention is covered
# name -> the checkpoint it runs: every family, and the RoPE scalings that take GGUF keys or tensors
CHECKS: dict[str, Check] = {
    **{family: Check(family) for family in FAMILIES},
    "gemma2": Check("gemma2", _WINDOW),
    "gemma3": Check("gemma3", _WINDOW),
    "llama-rope-llama3": Check("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }}),
    "qwen2-rope-yarn": Check("qwen2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    }}),
    "gemma3-rope-linear": Check("gemma3", {**_WINDOW, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }}),
    # llama.cpp takes the short factors while its context is at most the original one, as
    # transformers does for sequences that short; the attention factor applies to both.
    "phi3-rope-longrope": Check("phi3", {
        "max_position_embeddings": 4096, "original_max_position_embeddings": 512, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0 + i for i in range(8)],
            "short_factor": [1.0 + i / 4 for i in range(8)],
        },
    }),
}
PROMPT_LENGTHS = (3, 9, 20)
TIE_MARGIN = 1e-3
TEXTS = (
    "Hello world, the people find 2024 words!",
    " two  spaces, a tab\tand\nlines\n\nend",
    "caf\u00e9 \u6771\u4eac \U0001f999 <|im_start|> user<|im_end|>",
)
CHECK_SERVER_ARGS = ("-c", "512", "-np", "1", "-t", "2", "--no-warmup")


@dataclass(frozen=True)
class Divergence:
    step: int
    runner_up: int  # transformers' second choice at that step
    margin: float  # transformers' top-1 minus top-2 logit there
    llama_cpp_token: int

    @property
    def is_tie(self) -> bool:
        return self.llama_cpp_token == self.runner_up and self.margin < TIE_MARGIN


@dataclass(frozen=True)
class PromptResult:
    prompt: list[int]
    reference: list[int]  # transformers
    llama_cpp: list[int]  # ends early, with the token, where llama.cpp generated an end-of-generation token
    divergence: Divergence | None  # where transformers and llama.cpp first differ

    @property
    def matches(self) -> bool:
        return self.divergence is None

    @property
    def agrees(self) -> bool:
        """The same tokens, or the same up to llama.cpp taking the runner-up of a float tie."""
        return self.divergence is None or self.divergence.is_tie


@dataclass(frozen=True)
class TextResult:
    text: str
    reference: list[int]  # the checkpoint's tokenizer, special tokens added and parsed
    llama_cpp: list[int]

    @property
    def matches(self) -> bool:
        return self.reference == self.llama_cpp


@dataclass(frozen=True)
class CheckResult:
    greedy: list[PromptResult]
    tokenization: list[TextResult]


def run_check(
    name: str, llama_server: Path, work_dir: Path, file_type: str = "F32", new_tokens: int = 16, seed: int = 0
) -> CheckResult:
    check = CHECKS[name]
    checkpoint = random_checkpoint(check.family, work_dir / name, seed=seed, **check.overrides)
    gguf_path = export_gguf(checkpoint, work_dir / f"{name}-{file_type}.gguf", file_type)
    prompts = _prompts(json.loads((checkpoint / "config.json").read_text())["vocab_size"], seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    references = [_transformers_greedy(model, prompt, new_tokens) for prompt in prompts]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    log_path = work_dir / f"{name}-server.log"
    with LlamaServer(llama_server, gguf_path, log_path, CHECK_SERVER_ARGS) as server:
        outputs = [server.greedy(prompt, new_tokens) for prompt in prompts]
        tokenized = [server.tokenize(text) for text in TEXTS]
    return CheckResult(
        greedy=[
            PromptResult(prompt, tokens, output, _divergence(runners_up, tokens, output))
            for prompt, (tokens, runners_up), output in zip(prompts, references, outputs)
        ],
        tokenization=[TextResult(text, tokenizer.encode(text), ids) for text, ids in zip(TEXTS, tokenized)],
    )


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # ids past the first few hundred may be unused padding entries; any id is a valid input
    return [
        torch.randint(3, min(vocab_size, 400), (length,), generator=generator).tolist() for length in PROMPT_LENGTHS
    ]


def _transformers_greedy(
    model: torch.nn.Module, prompt: list[int], new_tokens: int
) -> tuple[list[int], list[tuple[int, float]]]:
    """The greedy tokens, and at each step the runner-up token and its logit margin."""
    ids = list(prompt)
    runners_up = []
    with torch.no_grad():
        for _ in range(new_tokens):
            top = torch.topk(model(torch.tensor([ids])).logits[0, -1], 2)
            runners_up.append((int(top.indices[1]), float(top.values[0] - top.values[1])))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], runners_up


def _divergence(runners_up: list[tuple[int, float]], reference: list[int], output: list[int]) -> Divergence | None:
    for step, (expected, got) in enumerate(zip(reference, output)):
        if expected != got:
            return Divergence(step, *runners_up[step], llama_cpp_token=got)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember_bench.llama_cpp_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, type=Path, help="path of llama.cpp's llama-server binary")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated families and RoPE variants")
    parser.add_argument("--file-type", default="F32", choices=list(FILE_TYPES))
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, help="keep the checkpoints, GGUF files and server logs here")
    parser.add_argument("--verbose", action="store_true", help="print every prompt's tokens")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.checks.split(",") if name.strip()]
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = args.work_dir or Path(scratch)
        work_dir.mkdir(parents=True, exist_ok=True)
        failed = []
        for name in names:
            result = run_check(name, args.llama_server, work_dir, args.file_type, args.new_tokens, args.seed)
            greedy_matched = sum(prompt.matches for prompt in result.greedy)
            greedy_tied = sum(prompt.agrees and not prompt.matches for prompt in result.greedy)
            texts_matched = sum(text.matches for text in result.tokenization)
            tied = f" (+{greedy_tied} up to a float tie)" if greedy_tied else ""
            print(f"{name:18s} {args.file_type}: {greedy_matched}/{len(result.greedy)} prompts give the same greedy "
                  f"tokens{tied}, {texts_matched}/{len(result.tokenization)} texts the same token ids")
            for prompt in result.greedy:
                if args.verbose:
                    print(f"    prompt {prompt.prompt} -> transformers {prompt.reference}")
                if prompt.divergence is not None:
                    where = prompt.divergence
                    print(f"    prompt {prompt.prompt}\n      transformers {prompt.reference}\n"
                          f"      llama.cpp    {prompt.llama_cpp}\n      step {where.step}: transformers' runner-up "
                          f"{where.runner_up} by a logit margin of {where.margin:.3g}")
            for text in result.tokenization:
                if not text.matches:
                    print(f"    text {text.text!r}\n      transformers {text.reference}\n"
                          f"      llama.cpp    {text.llama_cpp}")
            if not all(prompt.agrees for prompt in result.greedy) or texts_matched != len(result.tokenization):
                failed.append(name)
    print("all checks agree" if not failed else f"disagreeing: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
