"""Every package folder is listed in pyproject.toml, so a non-editable install (the Docker images) has it."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: Path(path) for name, path in setuptools["package-dir"].items()}
    expected = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([name, *relative.parts]))
    assert expected == set(setuptools["packages"])
