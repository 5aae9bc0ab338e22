"""A non-editable install (the Docker images) has every module, data file and C++ source: setuptools
finds the packages (pyproject.toml's [tool.setuptools.packages.find]), so a folder is shipped only
if it is a package, named as one."""

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# Where the packages live, and the files under them that are not shipped.
PACKAGE_ROOTS = [ROOT / "ember_core", *sorted((ROOT / "services").glob("ember_*")), ROOT / "proto" / "ember_proto"]
NOT_SHIPPED = {"README.md", "__pycache__"}


def test_the_wheel_holds_every_file_of_every_package(tmp_path: Path) -> None:
    # Built from a copy of the sources, since setuptools would reuse a stale build/ of the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("ember_core", "services", "proto"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("ember-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "/".join([root.name, *path.relative_to(root).parts])
        for root in PACKAGE_ROOTS
        for path in root.rglob("*")
        if path.is_file() and not NOT_SHIPPED & set(path.parts) and path.suffix in {".py", ".cpp", ".h", ".js", ".css", ".html"}
    }
    assert expected and not expected - shipped, sorted(expected - shipped)


def test_every_kernel_source_ships_with_the_package() -> None:
    """cpu_ops builds the extension at run time from the .cpp and .h files next to it."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    kernels = ROOT / "ember_core" / "kernels"
    needed = {path.name for path in kernels.iterdir() if path.suffix in {".cpp", ".h"}}
    shipped = {path.name for pattern in patterns["ember_core.kernels"] for path in kernels.glob(pattern)}
    assert needed and needed <= shipped
