"""The analyzer's path for large runs: digests, matching in suspect groups only, and parts read
by glob. It must name what the exact path names. Forced here on a 64-rank simulated run by
lowering the limits, so that it runs in seconds."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

import analyzer.db as db
import analyzer.membership as membership
import analyzer.parts as parts
from analyzer.db import open_run
from analyzer.findings import analyze
from analyzer.synth import SynthConfig, parse_injections, synthesize

MESH = {"dp": 4, "pp": 2, "tp": 8, "cp": 1}  # rank = (pp * 4 + dp) * 8 + tp


def synth(path, *specs: str, steps: int = 10) -> str:
    cfg = SynthConfig(
        mesh=dict(MESH), steps=steps, microbatches=4, faults=parse_injections(specs, 64), seed=3
    )
    synthesize(cfg, str(path), specs)
    return str(path)


def named(report: dict) -> list[tuple[str, list[int]]]:
    """Findings and dismissed candidates (a pipeline hop slowed 3x costs under 1% here)."""
    return sorted((f["kind"], f["ranks"]) for f in report["findings"] + report["dismissed"])


@pytest.mark.parametrize(
    "spec, kind, ranks",
    [
        (None, None, None),
        ("slow_rank:rank=13,factor=1.3", "straggler", [13]),
        ("slow_link:ranks=3-35,factor=3", "slow_link", [3, 35]),  # a pipeline pair
        ("slow_link:ranks=1-9,factor=3", "slow_link", [1, 9, 17, 25]),  # one dp group
        ("hang:rank=21,step=4", "hang", [21]),
        ("crash:rank=40,step=4", "crash", [40]),
    ],
)
def test_the_scale_path_names_what_the_exact_path_names(tmp_path, spec, kind, ranks):
    run = open_run(synth(tmp_path / "run", *([spec] if spec else [])))
    exact = named(analyze(run))
    scaled = named(analyze(run, exact_max_ranks=8))
    assert scaled == exact
    if kind is None:
        assert not [k for k, _ in scaled if k in ("straggler", "slow_link", "hang", "crash")]
    else:
        assert (kind, ranks) in scaled


def test_a_restricted_run_matches_a_groups_collectives_exactly(tmp_path):
    run = open_run(synth(tmp_path / "run", steps=4))
    members = [8 * i + 3 for i in range(4)]  # dp group 3 of stage 0: tp index 3
    sub = run.restricted(members)
    assert sub.ranks == frozenset(members) and sub.parts["collectives"] == 4
    q = (
        "select * from collective_instances where \"group\" = 'dp' and gid = "
        "(select gid from group_members where \"group\" = 'dp' and rank = 3) "
        "order by seq"
    )
    whole, part = run.sql(q), sub.sql(q)
    assert len(whole) > 0
    assert whole.equals(part)


def test_a_table_read_by_glob_skips_a_corrupt_part_and_still_names_the_culprit(
    tmp_path, monkeypatch, caplog
):
    run_dir = synth(tmp_path / "run", "slow_rank:rank=13,factor=1.3")
    bad = os.path.join(run_dir, "collectives", "rank=00050", "part-000000.parquet")
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    monkeypatch.setattr(parts, "FULL_PROBE_MAX_FILES", 16)  # 64 rank folders: read by glob
    with caplog.at_level(logging.WARNING, logger="analyzer.db"):
        run = open_run(run_dir)
    assert run.files["spans"] is None  # never listed
    assert run.skipped == [bad]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and bad in warnings[0] and "\n" not in warnings[0]
    assert ("straggler", [13]) in named(analyze(run, exact_max_ranks=8))
    assert run.sql("select count(*) as n from collectives where rank = 50").n[0] == 0


def test_hosts_of_a_large_run_are_read_for_the_named_ranks_only(tmp_path, monkeypatch):
    run_dir = synth(tmp_path / "run", "slow_rank:rank=13,factor=1.3")
    monkeypatch.setattr(parts, "FULL_PROBE_MAX_FILES", 16)
    run = open_run(run_dir)
    assert run.sql("select count(host) as n from rank_coords").n[0] == 0  # mesh coordinates
    (finding,) = [f for f in analyze(run, exact_max_ranks=8)["findings"]]
    assert finding["hosts"] == ["node1"]  # simulated hosts hold 8 ranks each
    shutil.rmtree(os.path.join(run_dir, "topology"))
    assert membership.hosts(run, [13]) == {13: None}


def test_restricted_runs_are_reused_and_at_most_a_few_stay_open(tmp_path):
    run = open_run(synth(tmp_path / "run", steps=3))
    first = run.restricted([0, 1])
    assert run.restricted({1, 0}) is first
    for r in range(2, 2 + db.RESTRICTED_KEPT):
        run.restricted([r])
    assert len(run._restricted) == db.RESTRICTED_KEPT  # noqa: SLF001
    with pytest.raises(Exception):  # noqa: B017 (closed: DuckDB's own error type)
        first.sql("select 1")
    again = run.restricted([0, 1])
    assert again is not first and again.sql("select count(*) as n from collectives").n[0] > 0
    run.close()
    with pytest.raises(Exception):  # noqa: B017
        again.sql("select 1")


def test_a_complete_restricted_run_holds_only_the_instances_all_its_members_entered(tmp_path):
    """``complete=True`` leaves out the rows of groups and send/recv pairs reaching outside the
    ranks (the detectors' matching); what remains reads as in the whole run."""
    run = open_run(synth(tmp_path / "run", steps=4))
    ranks = [8 * i + 3 for i in range(4)] + [35, 2]  # dp group 3 of stage 0, its pp peer, a tp one
    key = ["group", "gid", "src", "dst", "seq"]
    whole = run.sql("select * from collective_instances order by all")
    sizes = run.sql(
        'select "group", gid, count(*) as n, list(rank) as members from group_members group by all'
    )
    full = {
        (g, int(i))
        for g, i, m in zip(sizes["group"], sizes.gid, sizes.members, strict=True)
        if set(m) <= set(ranks)
    }
    inside = whole[
        whole.apply(
            lambda r: ({r.src, r.dst} <= set(ranks)) if r.src >= 0 else (r.group, r.gid) in full,
            axis=1,
        )
    ]
    assert len(inside) > 0 and {g for g, _ in full} == {"dp", "pp"}  # not tp: 2 of 8
    sub = run.restricted(ranks, complete=True)
    assert sub is not run.restricted(ranks) and sub is run.restricted(set(ranks), complete=True)
    part = sub.sql("select * from collective_instances order by all")
    assert (
        part.sort_values(key)
        .reset_index(drop=True)
        .equals(inside.sort_values(key).reset_index(drop=True))
    )
    assert set(zip(part.src, part.dst, strict=True)) - {(-1, -1)} == {(3, 35), (35, 3)}
