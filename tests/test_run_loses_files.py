"""A run that loses files under its readers (issue 48): ``megascope watch --once`` on a run whose
rank folder was removed, or whose Parquet part is truncated, answers from what is there with one
line about what is missing; the dashboard, on a run that loses a rank folder between two polls,
keeps serving every view and says in its run line what is missing. No rank starts."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
from helpers.cli import megascope
from helpers.dash import callback
from helpers.small_run import write_small_run
from helpers.world import World, write_world

MESH = {"dp": 2, "pp": 2, "tp": 2}
POLL = "..version.data...poll.disabled...run-info.children.."


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> str:
    """A run of 8 ranks, rank 5 at 1.4x."""
    run = str(tmp_path_factory.mktemp("loses") / "whole")
    write_world(World(slow_rank={5: 1.4}, seed=3), run)
    return run


def _warned(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("megascope: warning:")]


def _lose_rank(run: str, rank: int, tables: tuple[str, ...] = ()) -> None:
    for folder in glob.glob(os.path.join(run, "*", f"rank={rank:05d}")):
        if not tables or os.path.basename(os.path.dirname(folder)) in tables:
            shutil.rmtree(folder)


@pytest.mark.parametrize(
    ("tables", "said"), [((), "rank 2 (heartbeats, spans)"), (("spans",), "rank 2 (spans)")]
)
def test_watch_once_on_a_run_that_lost_a_rank_folder(whole, tmp_path, tables, said):
    run = str(tmp_path / "run")
    shutil.copytree(whole, run)
    _lose_rank(run, 2, tables)
    got = megascope("watch", run, "--once", "--window", "8")
    assert got.returncode == 3, got.stderr  # the straggler, from the other ranks
    assert "Traceback" not in got.stdout + got.stderr
    assert "straggler 5 " in got.stdout, got.stdout
    (line,) = _warned(got.stderr)
    assert f"missing the folders of {said}" in line and run in line, line


def test_watch_once_on_a_run_with_a_truncated_part(whole, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(whole, run)
    (part,) = glob.glob(os.path.join(run, "heartbeats", "rank=00003", "*.parquet"))[:1]
    os.truncate(part, 10)
    got = megascope("watch", run, "--once", "--window", "8")
    assert got.returncode == 3 and "Traceback" not in got.stdout + got.stderr, got.stderr
    assert "straggler 5 " in got.stdout, got.stdout
    (line,) = _warned(got.stderr)
    assert part in line and "unreadable" in line, line


def test_dashboard_keeps_serving_a_run_that_loses_a_rank_folder(tmp_path):
    from dashboard.app import create_app

    root = tmp_path / "root"
    run = write_small_run(str(root / "a"), MESH, steps=4, slow_rank=5, status="running")
    client = create_app(str(root)).server.test_client()

    def poll(n: int, old: object) -> dict:
        return callback(client, POLL, [("poll", "n_intervals", n), ("run", "value", "a")],
                        [("version", "data", old)])  # fmt: skip

    first = poll(0, None)
    before = first["version"]["data"]
    assert "missing" not in first["run-info"]["children"]
    _lose_rank(run, 2)

    def views(version: object) -> None:
        heat = callback(client, "heatmap.figure", [
            ("tabs", "value", "heatmap"), ("version", "data", version),
            ("heatmap-measure", "value", "peers"), ("steps", "value", [0, 3]),
            ("selected", "data", []),
        ])["heatmap"]["figure"]  # fmt: skip
        assert heat["data"] and "annotations" not in heat["layout"], heat["layout"]
        topo = callback(client, "..topology.figure...slab.figure...slab-box.style..", [
            ("version", "data", version), ("metric", "value", "compute"),
            ("steps", "value", [0, 3]), ("slice-axis", "value", "pp"), ("slice-index", "value", 0),
            ("cp", "value", -1), ("selected", "data", [2]), ("work", "value", "time"),
        ])["topology"]["figure"]  # fmt: skip
        assert topo["data"]
        line = callback(client, "timeline.figure", [
            ("tabs", "value", "timeline"), ("selected", "data", [2, 3]),
            ("timeline-step", "value", 1), ("version", "data", version), ("steps", "value", [0, 3]),
        ])["timeline"]["figure"]  # fmt: skip
        assert any("r3 " in str(t.get("hovertext")) for t in line["data"]), line["data"]

    views(before)  # a figure asked before the next poll: the old version's connection
    second = poll(1, before)
    after = second["version"]["data"]
    assert after != before
    info = second["run-info"]["children"]
    assert "missing the folders of rank 2 (heartbeats, spans)" in info, info
    views(after)


def test_missing_ranks_reads_compacted_folders_and_ignores_tables_no_rank_wrote(tmp_path):
    from analyzer.parts import missing_ranks, missing_text

    run = str(tmp_path)
    for folder in ("spans/ranks=0-3", "spans/rank=00005", "heartbeats/rank=00000"):
        os.makedirs(os.path.join(run, folder))
    assert missing_ranks(run, 6) == {1: ["heartbeats"], 2: ["heartbeats"], 3: ["heartbeats"],
                                     4: ["heartbeats", "spans"], 5: ["heartbeats"]}  # fmt: skip
    assert missing_text(run, 6) == "ranks 1, 2, 3, 5 (heartbeats); rank 4 (heartbeats, spans)"
    shutil.rmtree(os.path.join(run, "heartbeats"))
    assert missing_text(run, 6) == "rank 4 (spans)" and missing_text(run, 4) is None
