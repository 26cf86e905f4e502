"""Rules of the code base that a reader relies on, checked on the source itself: the Python the
project promises is the one it is written for and tested on; no import cycles between modules
(imports inside functions count); no private name imported across modules; the load generator,
a client of the server, imports nothing from the frontend."""

from __future__ import annotations

import ast
import configparser
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "frontend", "engine_core", "protocol", "loadgen")


def python_floor() -> tuple[int, int]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", cfg["options"]["python_requires"].strip())
    assert match, "python_requires should be a plain floor, >=X.Y"
    return int(match[1]), int(match[2])


def test_one_python_floor_everywhere_and_the_tests_run_on_it() -> None:
    """asyncio.wait_for raises TimeoutError only from 3.11 on, and the code catches
    TimeoutError: setup.cfg, ruff's target and the README must all promise 3.11 or newer, and
    this suite (what CI runs) must run on a Python the project promises."""
    major, minor = python_floor()
    assert (major, minor) >= (3, 11)
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert ruff["target-version"] == f"py{major}{minor}"
    assert f"Python ≥ {major}.{minor}" in (ROOT / "README.md").read_text()
    assert sys.version_info[:2] >= (major, minor)


def modules() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, ast.parse(path.read_text(), str(path))


def imported(tree: ast.Module) -> Iterator[tuple[str, list[str]]]:
    """(module, names) for every import statement, at any depth (functions included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def project_graph() -> dict[str, set[str]]:
    trees = dict(modules())
    graph: dict[str, set[str]] = {name: set() for name in trees}
    for name, tree in trees.items():
        for module, names in imported(tree):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in trees]
            targets = targets or ([module] if module in trees else [])
            graph[name].update(t for t in targets if t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert cycles(project_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_modules() -> None:
    offenders = [
        f"{name} imports {module}.{n}"
        for name, tree in modules()
        for module, names in imported(tree)
        if module.split(".")[0] in PACKAGES
        for n in names
        if n.startswith("_")
    ]
    assert offenders == []


def test_the_load_generator_imports_nothing_from_the_frontend() -> None:
    graph = project_graph()
    assert {t for m, ts in graph.items() if m.startswith("loadgen") for t in ts if
            t.startswith("frontend")} == set()  # fmt: skip
