"""The commit-msg hook `make install` sets up: subjects of at most 72 characters, a blank line
before the body."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HOOK = Path(__file__).parents[2] / ".githooks" / "commit-msg"


def run_hook(message: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    return subprocess.run([sys.executable, str(HOOK), str(path)], check=False, capture_output=True, text=True)


@pytest.mark.parametrize(
    "message",
    [
        "Bound JSON whitespace\n",
        "x" * 72 + "\n\nA body line of any length, with the figures: " + "9" * 200 + "\n",
        "Ratios × 1.5 in the subject count characters, not bytes — " + "é" * 13 + "\n",
        "Subject\n# a comment line git strips\n\nBody\n",
    ],
)
def test_a_subject_of_at_most_72_characters_passes(message: str, tmp_path: Path) -> None:
    result = run_hook(message, tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("message", "complaint"),
    [
        ("x" * 73 + "\n", "73 characters"),
        ("\n\nBody only\n", "empty"),
        ("Subject\nBody straight after it\n", "blank"),
    ],
)
def test_a_long_subject_or_a_missing_blank_line_is_refused(message: str, complaint: str, tmp_path: Path) -> None:
    result = run_hook(message, tmp_path)
    assert result.returncode != 0 and complaint in result.stderr
