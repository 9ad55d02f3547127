"""A late rank's arrival blame counts the time its peers waited for it once, however many groups
they waited in (analyzer/sql/findings/arrival_blame.sql): a tensor-parallel collective and a
prefetched all-gather of another group, both waiting for the same late rank, overlap (issue 47:
torchtitan's FSDP2 + TP run charged its late rank over twice its own excess)."""

from __future__ import annotations

import pytest
from helpers.small_run import MS, T0, PartsWriter, write_meta

from analyzer.db import open_run
from tracer.rundir import coords_of, write_part
from tracer.schema import TABLES

MESH = {"dp": 4, "pp": 1, "tp": 1, "cp": 1}
LATE = 1


def _write(run: str, steps: int = 3) -> str:
    """Each step: the peers enter a ``tp`` all-reduce at 10 ms and a ``dp`` all-gather at
    12 ms, the late rank both at 30 ms (overlapping gaps: 20 ms of waiting, not 38); then a
    ``dp`` reduce-scatter, the peers at 50 ms and the late rank at 55 ms (5 ms more, apart)."""
    write_meta(run, MESH, "cpu", "finished", LATE, 1.5)
    for r in range(4):
        topo = {f.name: [] for f in TABLES["topology"]}
        row = dict(rank=r, host="node0", local_rank=r, pid=1000 + r, device="cpu",
                   gpu_uuid=None, clock_offset_ns=0, **coords_of(r, MESH))  # fmt: skip
        for k, v in row.items():
            topo[k].append(v)
        write_part(run, "topology", r, topo)
    w = PartsWriter(4)
    for step in range(steps):
        t0 = T0 + step * 100 * MS
        for op, group, peers_at, late_at in (
            ("all_reduce", "tp", 10, 30),
            ("all_gather", "dp", 12, 30),
            ("reduce_scatter", "dp", 50, 55),
        ):
            end = t0 + (late_at + 1) * MS
            for r in range(4):
                at = late_at if r == LATE else peers_at + r * 0.1  # peers a little apart
                w.coll(r, step, op, group, 4, -1, group, t0 + int(at * MS), end)
        for r in range(4):
            w.span(r, step, "step", "host", t0, t0 + 60 * MS)
    w.flush(run)
    return run


@pytest.fixture(scope="module")
def blame(tmp_path_factory):
    db = open_run(_write(str(tmp_path_factory.mktemp("blame") / "run")))
    try:
        return db.query("findings/arrival_blame", lo=0, hi=1 << 30)
    finally:
        db.close()


def test_overlapping_waits_in_two_groups_count_once(blame) -> None:
    late = blame[blame["rank"] == LATE].sort_values("step")
    assert list(late["step"]) == [0, 1, 2], blame
    # the union of the gaps: 30 - 10.3 (tp's second-to-last arrival, rank 3) + 55 - 50.3
    want = (30 - 10.3) + (55 - 50.3)
    assert [round(b / MS, 1) for b in late["blame_ns"]] == [round(want, 1)] * 3, late
    assert list(late["last_count"]) == [3, 3, 3], late


def test_no_other_rank_is_blamed(blame) -> None:
    assert set(blame["rank"]) == {LATE}, blame


def test_a_stragglers_blame_beyond_its_peers(tmp_path) -> None:
    # a rank that sleeps 1.5x its untraced backward: its peers wait for it in every collective;
    # its blame beyond its peers' is at most its blame, and about its own excess
    from helpers.report import diagnose, shown
    from helpers.waiting_run import write_waiting_run

    report = diagnose(write_waiting_run(str(tmp_path / "run"), slow_rank=1, factor=1.5))
    top = report["findings"][0]
    assert (top["kind"], top["ranks"]) == ("straggler", [1]), shown(report)
    ev = top["evidence"]
    beyond, blame = ev["arrival_blame_beyond_peers_ms_per_step"], ev["arrival_blame_ms_per_step"]
    assert 0 < beyond <= blame, ev
    assert ev["excess_ms_per_step"] / 2 <= beyond <= 2 * ev["excess_ms_per_step"], ev
