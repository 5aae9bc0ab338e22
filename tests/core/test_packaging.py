"""Every package folder, and every C++ file the kernels build from, is listed in pyproject.toml, so a
non-editable install (the Docker images) has it."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_installed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: Path(path) for name, path in setuptools["package-dir"].items()}
    expected = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([name, *relative.parts]))
    assert expected == set(setuptools["packages"])


def test_every_kernel_source_ships_with_the_package() -> None:
    """cpu_ops builds the extension at run time from the .cpp and .h files next to it."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    kernels = ROOT / "ember_core" / "kernels"
    needed = {path.name for path in kernels.iterdir() if path.suffix in {".cpp", ".h"}}
    shipped = {path.name for pattern in patterns["ember_core.kernels"] for path in kernels.glob(pattern)}
    assert needed and needed <= shipped
