"""Writes workloads/fidelity.txt, the fixed text `ember bench fidelity` scores: sections of the
Python Language Reference as the standard library ships them (`pydoc_data.topics`, the PSF
License), prose with some code, 32,754 characters (7,875 SmolLM2 tokens).

    python -m ember_bench.make_fidelity_text > services/ember_bench/workloads/fidelity.txt

The file is kept as written on CPython 3.11, so the figures measured on it stay comparable; a later
Python's docs may word a section differently.
"""

from __future__ import annotations

import sys
from pydoc_data.topics import topics

TOPICS = ("execmodel", "naming", "exceptions", "for", "while", "try", "with", "truth")


def fidelity_text() -> str:
    return "\n\n".join(topics[name].strip() for name in TOPICS) + "\n"


if __name__ == "__main__":
    sys.stdout.write(fidelity_text())
