"""One run with one unreadable part, read by every command that reads a run: each leaves the
same part out, says so once, and answers from the rest (analyzer/db.py is the one reader)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers.cli import megascope
from helpers.world import World, write_world

PART = os.path.join("spans", "rank=00002", "part-000001.parquet")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, str]:
    """(a run with rank 5 at 1.4x, the same run with one of rank 2's span parts truncated)."""
    root = tmp_path_factory.mktemp("unreadable")
    whole, damaged = str(root / "whole"), str(root / "damaged")
    write_world(World(slow_rank={5: 1.4}, seed=3), whole)
    shutil.copytree(whole, damaged)
    victim = os.path.join(damaged, PART)
    os.truncate(victim, os.path.getsize(victim) // 3)
    return whole, damaged


def warned(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("megascope: warning:")]


def test_analyze_prices_the_straggler_on_what_can_be_read(runs):
    whole, damaged = runs
    got = megascope("analyze", damaged, "--json")
    assert got.returncode == 0, got.stderr
    assert len(warned(got.stderr)) == 1 and PART in warned(got.stderr)[0]
    (finding,) = json.loads(got.stdout)["findings"]
    (healthy,) = json.loads(megascope("analyze", whole, "--json").stdout)["findings"]
    assert (finding["kind"], finding["ranks"]) == ("straggler", [5])
    # priced by the what-if replay over the same readable parts, as on the whole run (a
    # what-if that read the folder again would fail on the part and leave an estimate)
    assert "saving_alone" in finding["evidence"] and "saving_alone" in healthy["evidence"]


def test_whatif_leaves_the_same_part_out(runs):
    _, damaged = runs
    got = megascope("whatif", damaged, "--json")
    assert got.returncode == 0, got.stderr
    assert len(warned(got.stderr)) == 1 and PART in warned(got.stderr)[0]
    report = json.loads(got.stdout)
    assert next(iter(report["by_rank"])) == "5"  # the rank whose fix saves most
    # rank 2's spans of the steps in the lost part are missing: those steps are left out
    assert report["run"]["steps"] and report["run"]["steps_left_out"]


def test_watch_names_the_straggler_from_the_rest(runs):
    _, damaged = runs
    got = megascope("watch", damaged, "--once", "--window", "8")
    assert got.returncode == 3, got.stderr  # a finding is active
    assert len(warned(got.stderr)) == 1 and PART in warned(got.stderr)[0]
    assert "straggler" in got.stdout and "5" in got.stdout.split("straggler", 1)[1].splitlines()[0]


def test_compact_names_the_same_part_and_leaves_it_out_when_forced(runs, tmp_path):
    _, damaged = runs
    run = str(tmp_path / "run")
    shutil.copytree(damaged, run)
    refused = megascope("compact", run)
    assert refused.returncode == 2 and PART in refused.stderr
    assert len(refused.stderr.strip().splitlines()[-1:]) == 1
    forced = megascope("compact", run, "--force")
    assert forced.returncode == 0, forced.stderr
    after = json.loads(megascope("analyze", run, "--json").stdout)["findings"]
    assert [(f["kind"], f["ranks"]) for f in after] == [("straggler", [5])]
