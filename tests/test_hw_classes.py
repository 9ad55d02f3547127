"""Hardware classes (docs/spec.md §2 topology ``hw_class``, §3 ``hardware_imbalance``).

A run that mixes hardware compares each rank with peers of its own class: a slower class is one
``hardware_imbalance`` finding, not a crowd of stragglers, and a straggler inside the fast class
is still named. Simulated with ``synth --hw-classes`` at 12,288 ranks (coarse detail, a few
steps) and on a small mesh whose stages mix classes (priced by the what-if there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cli import assert_one_line_error, megascope
from helpers.synth import synth_run
from helpers.tables import read

from analyzer.db import open_run
from analyzer.findings import analyze
from analyzer.synth import parse_hw_classes

BIG = {"dp": 192, "pp": 8, "tp": 8, "cp": 1}  # 12,288 ranks, classes cut along stages 0-3 | 4-7
TWO = "h200:0-6143:1.0,h100:6144-12287:1.15"
ONE = "h200:0-12287:1.0"
STRAGGLER = 1000  # in stage 0, of the fast class
SMALL = {"dp": 4, "pp": 2, "tp": 2, "cp": 1}  # each stage: dp 0-1 on class a, dp 2-3 on b
MIXED = "a:0-3:1.0,b:4-7:1.15,a:8-11:1.0,b:12-15:1.15"


def _big(path, classes: str) -> dict:
    run = synth_run(
        str(path),
        f"slow_rank:rank={STRAGGLER},factor=1.2",
        mesh=BIG,
        steps=6,
        detail="coarse",
        hw_classes=parse_hw_classes(classes, 12288),
    )
    r = open_run(run)
    try:
        return analyze(r)
    finally:
        r.close()


def _kinds(report: dict, kind: str) -> list[dict]:
    return [f for f in report["findings"] if f["kind"] == kind]


@pytest.fixture(scope="module")
def big_two(tmp_path_factory) -> dict:
    return _big(tmp_path_factory.mktemp("hw") / "two", TWO)


def test_a_slower_class_is_one_finding_beside_the_straggler_of_the_fast_class(big_two):
    slow = _kinds(big_two, "hardware_imbalance")
    assert len(slow) == 1
    f = slow[0]
    assert f["ranks"] == list(range(6144, 12288))
    assert f["evidence"]["hw_class"] == "h100" and f["evidence"]["other_classes"] == ["h200"]
    assert f["evidence"]["compared"] == "across stages"
    assert f["evidence"]["rank_ranges"] == "6144-12287"
    assert "hardware class h100 (6144 ranks: 6144-12287)" in f["message"]
    stragglers = _kinds(big_two, "straggler")
    assert [s["ranks"] for s in stragglers] == [[STRAGGLER]]
    assert stragglers[0]["evidence"]["hw_class"] == "h200"
    assert "hardware class h200" in stragglers[0]["message"]
    # the slow class's stages are its finding, not stage imbalances of their own
    assert _kinds(big_two, "stage_imbalance") == []


def test_one_class_is_no_hardware_imbalance(tmp_path):
    report = _big(tmp_path / "one", ONE)
    assert _kinds(report, "hardware_imbalance") == []
    assert [s["ranks"] for s in _kinds(report, "straggler")] == [[STRAGGLER]]
    assert "hw_class" not in _kinds(report, "straggler")[0]["evidence"]


@pytest.fixture(scope="module")
def small_two(tmp_path_factory) -> str:
    return synth_run(
        str(tmp_path_factory.mktemp("hw") / "small"),
        "slow_rank:rank=9,factor=1.3",
        mesh=SMALL,
        steps=12,
        hw_classes=parse_hw_classes(MIXED, 16),
        hosts=("h0", "h1"),
    )


def test_classes_within_a_stage_are_compared_at_the_same_work(small_two):
    run = open_run(small_two)
    try:
        report = analyze(run)
    finally:
        run.close()
    assert report["run"]["severity"]["method"] == "whatif"
    slow = _kinds(report, "hardware_imbalance")
    assert [f["ranks"] for f in slow] == [[4, 5, 6, 7, 12, 13, 14, 15]]
    assert slow[0]["evidence"]["compared"] == "same stage"
    assert slow[0]["severity"] > 0 and "saving_alone" in slow[0]["evidence"]
    stragglers = _kinds(report, "straggler")
    assert [s["ranks"] for s in stragglers] == [[9]]
    # its peers: the other ranks of stage 1 on class a (8, 10, 11), not the slower b ranks
    assert stragglers[0]["evidence"]["peers"] == 3
    assert {f["kind"] for f in report["findings"]} == {"hardware_imbalance", "straggler"}


def test_topology_keeps_each_ranks_class(small_two):
    rows = read(small_two, "topology")
    assert [r["hw_class"] for r in rows] == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4
    assert {r["device_name"] for r in rows} == {None}
    meta = json.loads(Path(small_two, "run.json").read_text())
    assert meta["tracer"]["extras"]["hw_classes"][1] == ["b", 4, 7, 1.15]


def test_dashboard_colours_and_groups_by_class(small_two):
    from dashboard import views
    from dashboard.source import RunSource

    src = RunSource(small_two)
    values = views.rank_values(src, "hw_class", 2, 11).set_index("rank")
    a, b = values.loc[[0, 1, 2, 3, 8, 9, 10, 11]], values.loc[[4, 5, 6, 7, 12, 13, 14, 15]]
    assert a.value.max() == 1.0 and b.value.min() > 1.0  # the slower class stands out
    grid = views.rank_step_grid(src, 2, 11, rank_bins=16, step_bins=1)
    # rows grouped by class: a's ranks first, then b's
    assert list(grid.rank_lo) == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    # peers are of the rank's class: the straggler's row stands out, b's ranks do not
    worst = grid.sort_values("peer_ratio").rank_lo.iloc[-1]
    assert worst == 9


def test_fleet_names_a_repeat_culprits_class(small_two, tmp_path):
    from analyzer.executor import make_engine
    from analyzer.fleet import fleet

    again = synth_run(
        str(tmp_path / "again"),
        "slow_rank:rank=9,factor=1.3",
        mesh=SMALL,
        steps=12,
        seed=1,
        hw_classes=parse_hw_classes(MIXED, 16),
        hosts=("h0", "h1"),
    )
    report = fleet([small_two, again], make_engine("local"), whatif=False)
    # each host holds ranks of both classes here (8 ranks a host, classes of 4)
    assert report["runs"][0]["host_classes"] == {"h0": "a+b", "h1": "a+b"}
    repeat = {e["host"]: e for e in report["repeat_culprits"]}
    assert repeat["h1"]["kinds"] == ["straggler"]
    assert repeat["h1"]["hw_classes"] == ["a+b", "a+b"]
    from analyzer.render.fleet import render_text
    from dashboard.fleet_page import render

    assert "h1 [a+b]: 2 runs" in render_text(report)
    assert "h1 [a+b] (2 runs: straggler)" in render(report)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("h100:0-9", "is not NAME:FIRST-LAST:SPEED"),
        ("h100:5-2:1.0", "not a range"),
        ("h100:0-99:1.0", "not a range of the 16 ranks"),
        ("a:0-9:1.0,b:9-15:1.1", "a and b overlap"),
        ("a:0-15:0", "SPEED must be > 0"),
    ],
)
def test_bad_hw_classes_are_one_line(tmp_path, spec, fragment):
    p = megascope(
        "synth", "--mesh", "dp=4,pp=2,tp=2", "--steps", "2", "--hw-classes", spec,
        "--out", str(tmp_path / "x"),
    )  # fmt: skip
    assert_one_line_error(p, "--hw-classes", fragment)


def test_classes_cut_along_stages_are_priced_as_one_finding(tmp_path):
    """Stages 2 and 3 on the slower class: one hardware_imbalance, priced by the what-if,
    in place of two stage imbalances (whose ranks it holds)."""
    run_dir = synth_run(
        str(tmp_path / "stages"),
        "slow_rank:rank=5,factor=1.3",
        mesh={"dp": 4, "pp": 4, "tp": 2, "cp": 1},
        steps=12,
        hw_classes=parse_hw_classes("a:0-15:1.0,b:16-31:1.15", 32),
    )
    run = open_run(run_dir)
    try:
        report = analyze(run)
    finally:
        run.close()
    assert report["run"]["severity"]["method"] == "whatif"
    kinds = sorted((f["kind"], f["ranks"]) for f in report["findings"])
    assert kinds == [("hardware_imbalance", list(range(16, 32))), ("straggler", [5])]
    slow = _kinds(report, "hardware_imbalance")[0]
    assert slow["evidence"]["compared"] == "across stages"
    assert slow["severity"] == slow["evidence"]["saving_alone"] > 0
    assert report["dismissed"] == []
