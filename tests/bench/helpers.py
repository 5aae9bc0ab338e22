"""Run the bench CLI in a worker thread with a deadline, so a hang fails the test instead of the suite."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

HANG_LIMIT_S = 180.0  # generous: a loaded machine imports transformers slowly; only a hang should trip it


def run_bench_cli(*argv: str, limit_s: float = HANG_LIMIT_S) -> int:
    from ember_bench.cli import main

    exit_code: list[int] = []

    def target() -> None:
        try:
            main(list(argv))
            exit_code.append(0)
        except SystemExit as exc:
            exit_code.append(int(exc.code or 0))

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(limit_s)
    assert not worker.is_alive(), f"ember bench {' '.join(argv)} still running after {limit_s} s"
    assert exit_code, "the CLI raised instead of exiting"
    return exit_code[0]


def write_workload(path: Path, max_tokens: list[int]) -> Path:
    items = [
        {"prompt": f"prompt number {i} " * 3, "max_tokens": n, "prompt_tokens": 9} for i, n in enumerate(max_tokens)
    ]
    path.write_text(json.dumps(items))
    return path


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
