"""The documentation's promises that a script can check: the README stays short and starts with
the two commands, the Makefile has them, and every relative link in the docs reaches a file (and
a heading, where it names one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The documents a reader reaches from the README, and the README itself.
DOCS = [
    README,
    ROOT / "deploy" / "README.md",
    ROOT / "docs" / "design.md",
    ROOT / "docs" / "attention-kernels.md",
    ROOT / "docs" / "benchmarks.md",
    ROOT / "docs" / "abuse.md",
    ROOT / "docs" / "security.md",
    ROOT / "services" / "ember_gateway" / "README.md",
    ROOT / "proto" / "README.md",
]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code_blocks(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _without_code_spans(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def github_anchors(path: Path) -> set[str]:
    """The ids GitHub gives a file's headings: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered."""
    anchors: set[str] = set()
    for line in _outside_code_blocks(path.read_text(encoding="utf-8")):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def relative_links(path: Path) -> list[str]:
    links = []
    for line in _outside_code_blocks(path.read_text(encoding="utf-8")):
        for target in LINK.findall(_without_code_spans(line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                links.append(target)
    return links


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        resolved = (doc.parent / file_part).resolve() if file_part else doc
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_document_it_was_split_into() -> None:
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in relative_links(README)}
    assert set(DOCS[1:]) <= linked, sorted(str(path.relative_to(ROOT)) for path in set(DOCS[1:]) - linked)


def test_the_readme_stays_short_and_narrow() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150
    wide = [f"{number}: {len(line)}" for number, line in enumerate(lines, 1) if len(line) > 100]
    assert not wide, f"README lines over 100 characters: {wide}"


def test_the_readme_opens_with_the_two_commands_and_the_makefile_has_them() -> None:
    text = README.read_text(encoding="utf-8")
    first_block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make run", "make test"]
    assert text.index("make run") < text.index("\n## ")  # before the first section
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^run serve:.*\n\t\$\(VENV\)/bin/ember serve", makefile, re.MULTILINE), "make run serves"
    assert re.search(r"^test:.*\n\t\$\(PY\) -m pytest", makefile, re.MULTILINE), "make test runs pytest"
