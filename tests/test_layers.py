"""The house's layers as a checked contract (docs/design.md): the dashboard above the analyzer
and the trainer, both above the tracer, nothing importing upward or sideways between the two
middle floors, and no two modules importing each other, directly or through others. The import
graph is grimp's (the library behind import-linter), built from the source, imports inside
functions included, and imports for type annotations alone (under ``if TYPE_CHECKING``)
included too: they run nothing, but a module that names another's types depends on it all the
same, so a circle closed by one is a circle. pyproject.toml's ``[tool.importlinter]`` states the
same layers for ``lint-imports``."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import grimp
import networkx as nx
import pytest

PACKAGES = ("tracer", "trainer", "analyzer", "dashboard")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAY_IMPORT = {
    "tracer": {"tracer"},
    "trainer": {"trainer", "tracer"},
    "analyzer": {"analyzer", "tracer"},
    "dashboard": {"dashboard", "analyzer", "tracer"},
}


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    g = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False)
    out = nx.DiGraph()
    for module in g.modules:
        out.add_node(module)
        for imported in g.find_modules_directly_imported_by(module):
            out.add_edge(module, imported)
    return out


def test_no_floor_imports_upward_or_sideways(graph):
    wrong = sorted(
        f"{a} -> {b}" for a, b in graph.edges if b.split(".")[0] not in MAY_IMPORT[a.split(".")[0]]
    )
    assert wrong == []


def test_no_two_modules_import_each_other(graph):
    circles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    assert circles == []


def test_the_graph_is_the_whole_house(graph):
    # a contract over an empty or partial graph would pass for nothing
    assert {m.split(".")[0] for m in graph} == set(PACKAGES)
    assert graph.has_edge("tracer.api", "tracer.core")
    assert graph.has_edge("dashboard.app", "analyzer.db") or any(
        a.startswith("dashboard") and b.startswith("analyzer") for a, b in graph.edges
    )


def _modules(tops: tuple[str, ...]) -> Iterator[str]:
    """Every Python module under the ``tops`` folders, relative to the project's root."""
    for top in tops:
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(d, name), ROOT)


def test_every_module_has_its_line_in_the_design_map():
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        design = f.read()
    missing = [path for path in _modules(PACKAGES) if f"`{path}`:" not in design]
    assert missing == [], "run scripts/module_map.py and update docs/design.md's map"


@pytest.fixture(scope="module")
def sources() -> dict[str, tuple[ast.Module, list[str]]]:
    """Every module of the house, the benches, the scripts and the tests: its tree, its lines."""
    out = {}
    for path in _modules((*PACKAGES, "bench", "scripts", "tests")):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        out[path] = (ast.parse(text, path), text.splitlines())
    return out


def _private_imports(path: str, tree: ast.Module) -> list[str]:
    """``from a.b import _name`` in ``path`` where ``a.b`` is another module of the house."""
    here = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] not in PACKAGES or node.module == here:
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                out.append(f"{path}: from {node.module} import {alias.name}")
    return out


def test_no_module_imports_another_modules_private_names(sources):
    """docs/design.md's review rule: a module is split along a seam of its job, never by size
    alone; what one half needs of the other is public, never an underscored name. The tests
    are held to it too: they test what the house offers, not its insides."""
    found = [hit for path, (tree, _) in sources.items() for hit in _private_imports(path, tree)]
    assert len(list(_modules(PACKAGES))) > 100  # the walk found the house
    assert found == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    """The underscored names a module defines: functions, classes, attributes it assigns
    (``self._x = ...``) and module-level names."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = node.name
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            name = node.attr
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.id
        else:
            continue
        if _private(name):
            out.add(name)
    return out


def _library_names(tree: ast.AST) -> set[str]:
    """Names a module binds by importing something outside the house (``os``, ``c10d``, a
    test helper)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in PACKAGES:
                    out.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] not in PACKAGES
        ):
            out.update(alias.asname or alias.name for alias in node.names)
    return out


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_module_reaches_into_another_modules_private_attributes(sources):
    """The same rule for attribute access, where it can be told apart from the source alone:
    ``x._name`` (x not ``self`` or ``cls``) where ``_name`` is an underscored name that another
    module of the house defines and this one does not. Libraries' own private names (torch's
    ``c10d._world``, ``os._exit``) are theirs; a line marked ``# noqa: SLF001`` says why it
    reaches in (a test that counts a cache)."""
    paths = list(sources)
    trees = {path: tree for path, (tree, _) in sources.items()}
    lines = {path: text for path, (_, text) in sources.items()}
    defined = {path: _defined_privates(tree) for path, tree in trees.items()}
    house = set().union(*(defined[p] for p in paths if p.split(os.sep)[0] in PACKAGES))
    libraries = {path: _library_names(tree) for path, tree in trees.items()}
    reaches = []  # (path, node) of each x._name on something not self
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            reaches.append((path, node))
    # what the house reaches in libraries (c10d._world) is the library's, wherever it is reached
    in_libraries = {n.attr for p, n in reaches if _root(n.value) in libraries[p]}
    found = sorted(
        f"{path}:{node.lineno}: {ast.unparse(node)}"
        for path, node in reaches
        if node.attr in house
        and node.attr not in defined[path]
        and node.attr not in in_libraries
        and _root(node.value) not in libraries[path]
        and "noqa: SLF001" not in lines[path][node.lineno - 1]
    )
    assert found == []
