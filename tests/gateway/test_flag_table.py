"""The gateway README's flag table is the one GatewayConfig generates. After changing a field, its
docstring or a flag, rewrite the table with: .venv/bin/python tests/gateway/test_flag_table.py"""

from __future__ import annotations

from pathlib import Path

from ember_core.config_flags import markdown_table
from ember_gateway.cli import GATEWAY_FLAGS

README = Path(__file__).resolve().parents[2] / "services" / "ember_gateway" / "README.md"
BEGIN = "<!-- flag table: generated from GatewayConfig by tests/gateway/test_flag_table.py -->\n"
END = "<!-- end of flag table -->\n"


def _parts(text: str) -> tuple[str, str, str]:
    """The README before the table, the table, and the README after it."""
    head, begin, rest = text.partition(BEGIN)
    table, end, tail = rest.partition(END)
    assert begin and end, f"{README} lost its flag table markers: {BEGIN.strip()} ... {END.strip()}"
    return head, table, tail


def test_the_readme_flag_table_is_the_generated_one() -> None:
    _, table, _ = _parts(README.read_text(encoding="utf-8"))
    assert table == markdown_table(GATEWAY_FLAGS), (
        f"{README} has a stale flag table; regenerate it: .venv/bin/python tests/gateway/test_flag_table.py"
    )


if __name__ == "__main__":
    head, _, tail = _parts(README.read_text(encoding="utf-8"))
    README.write_text(head + BEGIN + markdown_table(GATEWAY_FLAGS) + END + tail, encoding="utf-8")
