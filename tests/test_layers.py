"""The house's layers as a checked contract (docs/design.md): the dashboard above the analyzer
and the trainer, both above the tracer, nothing importing upward or sideways between the two
middle floors, and no two modules importing each other, directly or through others. The import
graph is grimp's (the library behind import-linter), built from the source, imports inside
functions included; an import for type annotations alone (under ``if TYPE_CHECKING``) runs
nothing and is left out."""

from __future__ import annotations

import grimp
import networkx as nx
import pytest

PACKAGES = ("tracer", "trainer", "analyzer", "dashboard")
MAY_IMPORT = {
    "tracer": {"tracer"},
    "trainer": {"trainer", "tracer"},
    "analyzer": {"analyzer", "tracer"},
    "dashboard": {"dashboard", "analyzer", "tracer"},
}


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    g = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
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


def test_every_module_has_its_line_in_the_design_map():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "design.md"), encoding="utf-8") as f:
        design = f.read()
    missing = [
        os.path.relpath(os.path.join(d, name), root)
        for pkg in PACKAGES
        for d, _, files in os.walk(os.path.join(root, pkg))
        for name in files
        if name.endswith(".py")
        and f"`{os.path.relpath(os.path.join(d, name), root)}`:" not in design
    ]
    assert missing == [], "run scripts/module_map.py and update docs/design.md's map"


MAX_MODULE_LINES = 450  # docs/design.md, "The map": a module past this is split by job


def test_no_module_outside_tests_is_over_450_lines():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tops = [*PACKAGES, "bench", "examples", "scripts", "samples"]
    sizes = {}
    for top in tops:
        for d, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(d, name)
                    with open(path, encoding="utf-8") as f:
                        sizes[os.path.relpath(path, root)] = sum(1 for _ in f)
    assert len(sizes) > len(PACKAGES)  # the walk found the house
    over = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert over == {}
