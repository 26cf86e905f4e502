"""Rules of the code base that a reader relies on, checked on the source itself: the Python the
project promises is the one it is written for and tested on; no import cycles between modules
(imports inside functions count); no private name imported across modules; the load generator,
a client of the server, imports nothing from the frontend; common/ imports nothing from the other
packages; only common/env.py reads the environment, and the README lists every variable it
reads; no product package imports the benchmarks."""

from __future__ import annotations

import ast
import configparser
import dataclasses
import functools
import re
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

from common import env

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "frontend", "engine_core", "protocol", "loadgen", "benchmarks")


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


@functools.cache
def modules() -> tuple[tuple[str, ast.Module], ...]:
    """Every module's name and tree, parsed once for all the rules (none changes a tree)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append((name, ast.parse(path.read_text(), str(path))))
    return tuple(found)


def imported(tree: ast.Module) -> Iterator[tuple[str, list[str]]]:
    """(module, names) for every import statement, at any depth (functions included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


@functools.cache
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


def test_the_output_interval_rule_is_written_once() -> None:
    """The engine process, the client library and the frontend apply one rule for when a
    request's tokens go on (protocol/output_interval.py), rather than each its own copy."""
    users = {"engine_core.server", "protocol.client", "frontend.generation"}
    graph = project_graph()
    assert all("protocol.output_interval" in graph[name] for name in users)


def test_common_imports_nothing_from_the_other_packages() -> None:
    graph = project_graph()
    assert {t for m, ts in graph.items() if m.startswith("common") for t in ts if
            not t.startswith("common")} == set()  # fmt: skip


# What product code may not point at: the diary of experiments and its logs, the one-off probes,
# a numbered entry of the diary, the issue tracker (not in the repository), one particular GPU.
DIARY_REFERENCES = {
    "the experiment diary": re.compile(r"docs/benchmarks\.md"),
    "a benchmark log": re.compile(r"docs/bench-logs"),
    "a device probe": re.compile(r"scripts/device"),
    "a numbered session": re.compile(r"\b\w+(th|st|nd|rd) session\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissue \d+", re.IGNORECASE),
    "one machine": re.compile(r"\b(an?|the) H[12]00s?\b"),
}
# benchmarks/ prints the tables that docs/benchmarks.md holds, so it may name that file, but
# not cite it by section.
RESULTS_BY_SECTION = re.compile(r'docs/benchmarks\.md,? "')
DESIGN_CITATION = re.compile(r'(docs/design/[\w.-]+\.md)((?:,| and) "[^"]+")*')


def product_files() -> Iterator[tuple[str, str]]:
    """(path, text with each line break and its indentation or comment marker one space) of
    every text file in the product packages, and in benchmarks/ where the tree has it."""
    for folder in dict.fromkeys((*PACKAGES, "benchmarks")):  # once, if PACKAGES names it
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            yield str(path.relative_to(ROOT)), joined(text)


def joined(text: str) -> str:
    """A comment or docstring wrapped over lines, as one line: a citation may be split."""
    return re.sub(r"\n[ \t]*(#[ \t]*)?", " ", text)


def design_citations(text: str) -> Iterator[tuple[str, list[str]]]:
    """(note path, the sections named after it) for each docs/design/ note the text cites, as
    in (docs/design/note.md, "Section") or (docs/design/note.md, "One" and "Other")."""
    for match in DESIGN_CITATION.finditer(text):
        yield match[1], re.findall(r'"([^"]+)"', match[0])


def note_sections(note: Path) -> list[str]:
    """A note's headings and bold labels: what a citation may name (or the start of one)."""
    text = note.read_text()
    headings = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return headings + [label.strip() for label in re.findall(r"\*\*(.+?)\*\*", text)]


def test_the_citation_finder_reads_wrapped_citations() -> None:
    source = textwrap.dedent(
        """
        # slower (docs/design/kernels-and-limits.md, "Decode
        # attention"); see docs/design/overlap-scheduling.md.
        x = 1  # docs/design/a.md, "One" and "Other"
        \"\"\"Or in a docstring (docs/design/b.md, "The
            warm-up steps").\"\"\"
        """
    )
    assert list(design_citations(joined(source))) == [
        ("docs/design/kernels-and-limits.md", ["Decode attention"]),
        ("docs/design/overlap-scheduling.md", []),
        ("docs/design/a.md", ["One", "Other"]),
        ("docs/design/b.md", ["The warm-up steps"]),
    ]
    assert DIARY_REFERENCES["a numbered session"].search(joined("# twenty-seventh\n# session"))


def test_product_code_points_to_no_diary_entry_probe_issue_or_machine() -> None:
    """Comments say why and point to a design note: never to docs/benchmarks.md (current
    figures, rewritten as they change), a log, a probe, an entry of the old diary, an issue
    number or one GPU model as if the code were for one machine. benchmarks/, whose tables the
    results page holds, may name that page but not a section of it."""
    offenders = []
    for path, text in product_files():
        patterns = dict(DIARY_REFERENCES)
        if path.startswith("benchmarks/"):
            patterns["the experiment diary"] = RESULTS_BY_SECTION
        offenders += [
            f"{path}: {what} ({match[0]!r})"
            for what, pattern in patterns.items()
            for match in pattern.finditer(text)
        ]
    assert offenders == []


def test_every_design_note_cited_in_product_code_exists_with_its_sections() -> None:
    """Each docs/design/ note that product code cites exists, and each section a citation names
    is the start of one of that note's headings or bold labels."""
    offenders = []
    for path, text in product_files():
        for note, sections in design_citations(text):
            if not (ROOT / note).is_file():
                offenders.append(f"{path}: {note} does not exist")
                continue
            known = note_sections(ROOT / note)
            offenders += [
                f'{path}: {note} has no section "{section}"'
                for section in sections
                if not any(heading.startswith(section) for heading in known)
            ]
    assert offenders == []


def environment_reads(tree: ast.Module) -> list[int]:
    """Lines that read the environment: os.getenv, environ or getenv imported from os, and any
    use of os.environ but setting a variable (os.environ[NAME] = ...) or copying the whole of it
    for a child process ({**os.environ, ...}, dict(os.environ), os.environ.copy())."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in ("environ", "getenv")]
        elif _is_os(node, "getenv") or (_is_os(node, "environ") and not _writes(node, parents)):
            lines.append(node.lineno)
    return sorted(lines)


def _is_os(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _writes(environ: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents[environ]
    if isinstance(parent, ast.Subscript):
        return isinstance(parent.ctx, (ast.Store, ast.Del))
    if isinstance(parent, ast.Dict):
        pairs = zip(parent.keys, parent.values, strict=True)
        return any(key is None and value is environ for key, value in pairs)
    if isinstance(parent, ast.Call):
        return isinstance(parent.func, ast.Name) and parent.func.id == "dict"
    return isinstance(parent, ast.Attribute) and parent.attr == "copy"


def test_the_environment_read_finder_finds_reads_not_writes() -> None:
    source = textwrap.dedent(
        """
        import os
        from os import getenv
        a = os.environ.get("A")
        b = os.getenv("B")
        c = os.environ["C"]
        d = "D" in os.environ
        os.environ["E"] = "1"
        del os.environ["E"]
        child = {**os.environ, "F": "1"}
        other = dict(os.environ), os.environ.copy()
        """
    )
    assert environment_reads(ast.parse(source)) == [3, 4, 5, 6, 7]


def test_only_common_env_reads_the_environment() -> None:
    offenders = [
        f"{name}, line {line}"
        for name, tree in modules()
        if name != "common.env"
        for line in environment_reads(tree)
    ]
    assert offenders == []


def test_the_readme_lists_every_environment_variable() -> None:
    """common/env.py's VARIABLES, and only those, in README.md's "Environment variables" table;
    every Variable the module defines is one of them."""
    defined = {v.name for v in vars(env).values() if isinstance(v, env.Variable)}
    assert defined == {v.name for v in env.VARIABLES}
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| `")]
    assert sorted(row.strip("`") for row in rows) == sorted(defined)


def test_no_product_package_imports_the_benchmarks() -> None:
    """The benchmarks drive the product from outside; nothing the server runs depends on them."""
    graph = project_graph()
    assert {m for m, ts in graph.items() if not m.startswith("benchmarks") for t in ts if
            t.startswith("benchmarks")} == set()  # fmt: skip


# Request's fields by their one writer (engine_core/request.py groups them the same way); the
# fields set when a request is made are written by nobody afterwards.
REQUEST_FIELD_OWNERS = {
    "engine_core.scheduler": {
        "token_ids", "num_computed_tokens", "status", "finish_reason", "num_preemptions",
        "num_cached_tokens", "stop_ids", "length_limit", "first_scheduled_time",
        "first_token_time", "finish_time", "first_token_index", "num_draft_tokens",
        "num_accepted_tokens",
    },
    "engine_core.core": {"grammar", "prompt_logprobs", "prompt_logprobs_sent"},
    "engine_core.server": {"held"},
}  # fmt: skip
REQUEST_NAMES = {"request", "r", "req", "victim"}  # what the engine core calls a Request
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove"}


def request_field_written(node: ast.AST) -> str | None:
    """The Request field that ``node`` (an assignment target, a deleted item or a mutating
    call) writes, where it is one of a request's (``request.x``, ``r.x[i]``, ``s.request.x``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value if node.func.attr in MUTATORS else node
    while isinstance(node, ast.Subscript):
        node = node.value
    if not isinstance(node, ast.Attribute):
        return None
    owner = node.value
    named = isinstance(owner, ast.Name) and owner.id in REQUEST_NAMES
    nested = isinstance(owner, ast.Attribute) and owner.attr == "request"
    return node.attr if named or nested else None


def request_writes(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call):
            targets = [node]
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                field = request_field_written(part)
                if field is not None:
                    yield field


def test_each_request_field_has_one_writer() -> None:
    """Every write to a Request's mutable fields in the engine core comes from the module that
    owns the field; the fields it is made with are never written again."""
    from engine_core.request import Request

    owned = set().union(*REQUEST_FIELD_OWNERS.values())
    fields = {f.name for f in dataclasses.fields(Request)}
    assert owned <= fields
    wrong = []
    for name, tree in modules():
        if not name.startswith("engine_core") or name == "engine_core.request":
            continue
        mine = REQUEST_FIELD_OWNERS.get(name, set())
        wrong += [(name, f) for f in request_writes(tree) if f in fields and f not in mine]
    assert wrong == []


def test_the_writer_finder_sees_each_kind_of_write() -> None:
    sample = ast.parse(
        "request.status = 1\nr.token_ids[3] = 5\ns.request.finish_time += 1.0\n"
        "del request.token_ids[4:]\nrequest.token_ids.append(-1)\nheld.token_ids += [1]\n"
        "x = request.status\n"
    )
    assert sorted(request_writes(sample)) == sorted(
        ["status", "token_ids", "finish_time", "token_ids", "token_ids"]
    )
