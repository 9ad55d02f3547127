"""List the functions of tracer/, trainer/, analyzer/ and dashboard/ longer than 80 lines.

A function's length is its lines from ``def`` to its last line (nested functions counted in
their parent too, and listed on their own). One that may stay long says why on the line above
its ``def`` (or above its first decorator): ``# long: <why>``. tests/test_layers.py holds the
four packages to that.

    .venv/bin/python scripts/long_functions.py [--limit 80] [--all]

prints ``LINES  path:line  qualified.name`` per function over the limit (``--all``: with those
that say why too) and exits 1 when one over it does not say why.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tracer", "trainer", "analyzer", "dashboard")
LIMIT = 80
WHY = "# long:"


@dataclass(frozen=True)
class Function:
    """One function: where it is, its qualified name, its length and why it is long (if said)."""

    path: str  # relative to the project's root
    line: int
    name: str  # module.Class.function (nested: module.outer.inner)
    lines: int
    why: str | None


def _module(path: str) -> str:
    mod = path[: -len(".py")].replace(os.sep, ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _walk(
    node: ast.AST, prefix: str
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{child.name}"
            yield name, child
            yield from _walk(child, name)
        elif isinstance(child, ast.ClassDef):
            yield from _walk(child, f"{prefix}.{child.name}")
        else:
            yield from _walk(child, prefix)


def functions(root: str = ROOT, packages: tuple[str, ...] = PACKAGES) -> Iterator[Function]:
    """Every function of ``packages`` under ``root``, with its length and its ``# long:``."""
    for pkg in packages:
        for d, _, files in sorted(os.walk(os.path.join(root, pkg))):
            for fname in sorted(files):
                if not fname.endswith(".py"):
                    continue
                path = os.path.relpath(os.path.join(d, fname), root)
                with open(os.path.join(root, path), encoding="utf-8") as f:
                    source = f.read()
                text = source.splitlines()
                for name, fn in _walk(ast.parse(source), _module(path)):
                    first = min([fn.lineno] + [dec.lineno for dec in fn.decorator_list])
                    above = text[first - 2].strip() if first >= 2 else ""
                    why = above[len(WHY) :].strip() if above.startswith(WHY) else None
                    end = fn.end_lineno or fn.lineno
                    yield Function(path, fn.lineno, name, end - fn.lineno + 1, why or None)


def long_functions(limit: int = LIMIT, root: str = ROOT) -> list[Function]:
    """The functions over ``limit`` lines, longest first."""
    return sorted((f for f in functions(root) if f.lines > limit), key=lambda f: -f.lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=LIMIT)
    parser.add_argument("--all", action="store_true", help="list those that say why too")
    args = parser.parse_args()
    found = long_functions(args.limit)
    unsaid = [f for f in found if f.why is None]
    for f in found if args.all else unsaid:
        why = f"  ({WHY} {f.why})" if f.why else ""
        print(f"{f.lines:5d}  {f.path}:{f.line}  {f.name}{why}")
    return 1 if unsaid else 0


if __name__ == "__main__":
    sys.exit(main())
