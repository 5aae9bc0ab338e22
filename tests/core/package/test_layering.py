"""The layers import downwards only: the library no service, the wire protocol and the gateway no
torch (nor the gateway numpy or any model library), and no module imports one that imports it back (checked on the source, lazy imports included)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ("ember_core", "ember_proto", "ember_engine", "ember_gateway", "ember_bench", "ember_cli")
SERVICES = {"ember_engine", "ember_gateway", "ember_bench", "ember_cli"}
# What importing every module of a package must not pull in.
FORBIDDEN = {
    "ember_core": SERVICES,
    "ember_proto": {"torch", "ember_core", *SERVICES},
    # the gateway's image installs deploy/gateway-requirements.txt only
    "ember_gateway": {"torch", "numpy", "safetensors", "gguf", "huggingface_hub", *SERVICES - {"ember_gateway"}},
    "ember_engine": SERVICES - {"ember_engine"},
    "ember_bench": SERVICES - {"ember_bench"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_every_module_of_a_package_pulls_in_nothing_above_it(package: str) -> None:
    code = (
        "import importlib, pkgutil, sys;"
        f"root = importlib.import_module({package!r});"
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(root.__path__, root.__name__ + '.')"
        " if not m.name.endswith('__main__')];"
        f"found = sorted(p for p in {sorted(FORBIDDEN[package])!r} if p in sys.modules);"
        "assert not found, found"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        folder = Path(importlib.util.find_spec(package).submodule_search_locations[0])
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported_names(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            name = node.module if not node.level else ".".join(filter(None, [base, node.module]))
            names |= {name, *(f"{name}.{alias.name}" for alias in node.names)}
    return names


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = _modules()

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    # A module's own packages are left out: a package's __init__ naming its submodules is no cycle.
    graph = {
        module: {o for name in _imported_names(module, path) if (o := owner(name)) and not f"{module}.".startswith(f"{o}.")}
        for module, path in modules.items()
    }
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, " ; ".join(" -> ".join(cycle) for cycle in cycles)
