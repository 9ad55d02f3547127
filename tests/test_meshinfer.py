"""The layout of an attached script read from its process groups (analyzer/meshinfer.py), on
group tables built here as the tracer records them: a pipelining schedule of 2 stages x 2
replicas over hand-made groups, one of 4 stages on the default group, data parallelism alone,
tensor parallelism inside pipeline stages, and cases where the groups cannot tell; and a
recorded run of examples/pipelining.py (2 stages x 2 replicas over its own ``new_group`` calls)
as the analyzer and the dashboard open it."""

from __future__ import annotations

import os

from helpers.paths import DATA

from analyzer import meshinfer
from analyzer.db import open_run
from analyzer.meshinfer import FirstSend, Traffic
from analyzer.render.words import headline


def p2p(pairs: list[tuple[int, int]], group: str = "world", n: int = 40) -> list[Traffic]:
    """Sends and receives both ways on each (stage, next stage) pair."""
    rows = []
    for a, b in pairs:
        for x, y in ((a, b), (b, a)):
            rows += [Traffic(x, group, y, "send", n), Traffic(x, group, y, "recv", n)]
    return rows


def first(pairs: list[tuple[int, int]], steps: int = 5) -> list[FirstSend]:
    """Activations first (a to b), gradients after (b to a), in every step."""
    rows = []
    for s in range(steps):
        for a, b in pairs:
            rows += [FirstSend(a, b, s, 1000 * s + 10), FirstSend(b, a, s, 1000 * s + 500)]
    return rows


def reduce(group: str, ranks: list[int], n: int = 10, inside: int = 0) -> list[Traffic]:
    """``n`` all_reduces on ``group`` by each of ``ranks``, ``inside`` of them in a forward."""
    return [Traffic(r, group, -1, "all_reduce", n, inside) for r in ranks]


def groups(**named: list[list[int]]) -> list[dict]:
    """run.json's ``groups``."""
    return [{"name": k, "ranks": r} for k, lists in named.items() for r in lists]


def test_two_stages_by_two_replicas_over_hand_made_groups():
    pairs = [(0, 1), (2, 3)]
    traffic = p2p([(0, 1)], "group2") + p2p([(2, 3)], "group3")
    traffic += reduce("group4", [0, 2]) + reduce("group5", [1, 3])
    g = groups(world=[[0, 1, 2, 3]], group2=[[0, 1]], group3=[[2, 3]], group4=[[0, 2]],
               group5=[[1, 3]])  # fmt: skip
    lay = meshinfer.infer(4, traffic, first(pairs), g)
    assert lay.told and lay.text() == "dp=2 x pp=2", lay
    assert lay.coords == [[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert "group4" in lay.evidence and "0 > 1" in lay.evidence


def test_four_stages_on_the_default_group_ordered_by_what_flows_first():
    # the stages hold ranks 3, 1, 0, 2 in that order: activations flow 3 > 1 > 0 > 2
    pairs = [(3, 1), (1, 0), (0, 2)]
    lay = meshinfer.infer(4, p2p(pairs), first(pairs), groups(world=[[0, 1, 2, 3]]))
    assert lay.told and lay.text() == "pp=4", lay
    assert [lay.coords[r][1] for r in (3, 1, 0, 2)] == [0, 1, 2, 3]


def test_data_parallel_alone_and_fsdp_read_as_dp():
    ddp = reduce("dp", [0, 1, 2, 3])
    lay = meshinfer.infer(4, ddp, [], groups(dp=[[0, 1, 2, 3]]))
    assert lay.told and lay.text() == "dp=4"
    # FSDP: all-gathers inside the forward, reduce-scatters in the backward
    fsdp = [Traffic(r, "world", -1, "all_gather", 20, 10) for r in range(4)]
    fsdp += [Traffic(r, "world", -1, "reduce_scatter", 10, 0) for r in range(4)]
    assert meshinfer.infer(4, fsdp, [], groups(world=[[0, 1, 2, 3]])).text() == "dp=4"


def test_tensor_parallel_groups_inside_the_stages():
    # 8 ranks: pp=2 x tp=2 x dp=2; tp groups (0,1) (2,3) on stage 0, (4,5) (6,7) on stage 1
    pairs = [(0, 4), (1, 5), (2, 6), (3, 7)]
    traffic = p2p(pairs)
    for g in ([0, 1], [2, 3], [4, 5], [6, 7]):
        traffic += reduce(f"tp{g[0]}", g, n=20, inside=10)
    for g in ([0, 2], [1, 3], [4, 6], [5, 7]):
        traffic += reduce(f"dp{g[0]}", g)
    lay = meshinfer.infer(8, traffic, first(pairs), [])
    assert lay.told and lay.text() == "dp=2 x pp=2 x tp=2", lay
    assert lay.coords[5] == [0, 1, 1, 0] and lay.coords[6] == [1, 1, 0, 0]


def test_what_the_groups_cannot_tell():
    world = groups(world=[[0, 1, 2, 3]])
    # only a barrier and a broadcast: no send/recv, no reduction
    quiet = [Traffic(r, "world", -1, op, 3) for r in range(4) for op in ("barrier", "broadcast")]
    lay = meshinfer.infer(4, quiet, [], world)
    assert not lay.told and "not told" in lay.why
    # a ring of sends: an interleaved pipeline or a context-parallel ring
    ring = [(0, 1), (1, 2), (2, 3), (3, 0)]
    lay = meshinfer.infer(4, p2p(ring), first(ring), world)
    assert not lay.told and "ring" in lay.why
    # a pipeline over two ranks, the other two outside any
    lay = meshinfer.infer(4, p2p([(0, 1)]) + reduce("world", [0, 1, 2, 3]), [], world)
    assert not lay.told and "no pipeline covers every rank" in lay.why
    # pipelines of 2 and of 3 ranks
    lay = meshinfer.infer(5, p2p([(0, 1), (2, 3), (3, 4)]), [], [])
    assert not lay.told and "different lengths" in lay.why


def test_the_report_says_so():
    meta = {"layout": {"source": "process groups", "told": False, "mesh": None, "evidence": "",
                       "why": "its process groups carry no send/recv and no reduction"}}  # fmt: skip
    note = meshinfer.note(meta)
    assert note is not None and note["message"].startswith("layout unknown")
    run = {"world_size": 4, "mesh": {"dp": 4}, "steps": [0, 9], "layout": meta["layout"]}
    assert headline({"run": run}).startswith("4 ranks (layout not told by its process groups)")
    told = {"source": "process groups", "told": True, "mesh": "dp=2 x pp=2", "evidence": "x"}
    run = {"world_size": 4, "mesh": {"dp": 2, "pp": 2, "tp": 1, "cp": 1}, "steps": [0, 9],
           "layout": told}  # fmt: skip
    assert headline({"run": run}).startswith("4 ranks (dp=2 x pp=2)")
    assert meshinfer.note({"layout": {**told, "mesh": "dp=4"}}) is None  # nothing to add


def test_which_runs_are_read():
    base = {"world_size": 4, "mesh": {"dp": 4, "pp": 1, "tp": 1, "cp": 1}, "tracer": {"x": 1},
            "model": {}}  # fmt: skip
    assert meshinfer.attached(base)
    assert not meshinfer.attached({**base, "coords": [[0, 0, 0, 0]] * 4})  # a named DeviceMesh
    assert not meshinfer.attached({**base, "model": {"config": {}}})  # megascope train
    assert not meshinfer.attached({**base, "mesh": {"dp": 2, "pp": 2}})
    assert not meshinfer.attached({**base, "import": {"tool": "kineto"}})


RECORDED = os.path.join(DATA, "cpu_runs", "pipelining_dp2_pp2")


def test_a_recorded_pipelining_run_opens_as_two_stages_by_two_replicas():
    db = open_run(RECORDED)
    try:
        assert db.mesh == {"dp": 2, "pp": 2, "tp": 1, "cp": 1}
        assert db.meta["layout"]["told"] and db.meta["layout"]["mesh"] == "dp=2 x pp=2"
        c = db.sql("select rank, dp, pp, tp from rank_coords order by rank")
        assert c["pp"].tolist() == [0, 1, 0, 1] and c["dp"].tolist() == [0, 0, 1, 1]
    finally:
        db.close()


def test_the_dashboard_groups_the_recorded_run_by_stage():
    from dashboard.source import RunSource

    src = RunSource(RECORDED)
    src.refresh()
    assert src.mesh == {"dp": 2, "pp": 2, "tp": 1, "cp": 1}
    topo = src.topology().sort_values("rank")
    assert topo["pp"].tolist() == [0, 1, 0, 1] and topo["dp"].tolist() == [0, 0, 1, 1]
