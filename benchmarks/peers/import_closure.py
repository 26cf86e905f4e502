"""What a peer's bundle lacks: the closure of module-level imports from its entry points, read
from the source without importing anything (a CPU machine cannot import a GPU build).

    python3 benchmarks/peers/import_closure.py /tmp/sgsite \\
        sglang.launch_server,sglang.srt.entrypoints.http_server sglang,sgl_kernel,flashinfer

Follows every module-level import of the packages named last (both branches of an ``if``, the
bodies of ``try`` counted optional, ``TYPE_CHECKING`` blocks skipped); imports inside functions
(lazy ones) are not followed: an over-approximation of one launch's imports. Prints, as JSON, the
outside modules imported unconditionally and those imported only where a failure is caught, each
with up to three modules that import it.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path


def module_file(site: Path, module: str) -> Path | None:
    """The source file of ``module`` under ``site``, if the bundle has it."""
    base = site.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules (and, for ``from x import y``, the candidates ``x.y``) an import statement
    names, relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def walk(
    body: list[ast.stmt], module: str, is_package: bool, optional: bool,
    out: list[tuple[str, bool]],
) -> None:  # fmt: skip
    """Append (imported module, optional) for every module-level import in ``body``."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out += [(name, optional) for name in imported_names(module, is_package, node)]
        elif isinstance(node, ast.Try):
            walk(node.body, module, is_package, True, out)
            for handler in node.handlers:
                walk(handler.body, module, is_package, True, out)
            walk(node.orelse + node.finalbody, module, is_package, optional, out)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            walk(node.body + node.orelse, module, is_package, True, out)
        elif isinstance(node, ast.With):
            walk(node.body, module, is_package, optional, out)


def closure(site: Path, entries: list[str], follow: set[str]) -> dict[str, object]:
    """Follow the imports from ``entries`` through the packages in ``follow``."""
    seen: set[str] = set()
    outside: dict[bool, dict[str, set[str]]] = {False: {}, True: {}}
    stack = list(entries)
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        path = module_file(site, module)
        if path is None:
            continue
        parts = module.split(".")
        stack += [".".join(parts[:i]) for i in range(1, len(parts))]  # parents import first
        found: list[tuple[str, bool]] = []
        walk(ast.parse(path.read_text(encoding="utf-8")).body, module,
             path.name == "__init__.py", False, found)  # fmt: skip
        for name, optional in found:
            if name.split(".")[0] in follow:
                if module_file(site, name) is not None:
                    stack.append(name)
            else:
                outside[optional].setdefault(name.split(".")[0], set()).add(module)
    required = outside[False]
    return {
        "modules_followed": len(seen),
        "required": {name: sorted(users)[:3] for name, users in sorted(required.items())},
        "optional_only": {
            name: sorted(users)[:3]
            for name, users in sorted(outside[True].items())
            if name not in required
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the unpacked bundle")
    parser.add_argument("entries", help="comma-separated entry modules")
    parser.add_argument("follow", help="comma-separated top-level packages to follow")
    args = parser.parse_args()
    result = closure(args.site, args.entries.split(","), set(args.follow.split(",")))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
