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


def _private_imports(path: str) -> list[str]:
    """``from a.b import _name`` in ``path`` where ``a.b`` is another module of the house."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
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


def test_no_module_imports_another_modules_private_names():
    """docs/design.md's review rule: a module is split along a seam of its job, never by size
    alone; what one half needs of the other is public, never an underscored name."""
    found = [
        hit for path in _modules((*PACKAGES, "bench", "scripts")) for hit in _private_imports(path)
    ]
    assert len(list(_modules(PACKAGES))) > 100  # the walk found the house
    assert found == []
