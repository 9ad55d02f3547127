"""The example scripts, which know nothing of megascope, traced unmodified and diagnosed.

Each run is ``torchrun --nproc-per-node 4 -m tracer.run examples/SCRIPT`` on gloo, as the README
says, with one rank made slower (at other places than the README's), healthy, or hung. The
diagnosis comes from what the tracer found by itself: DDP's gradient all-reduce and tensor
parallelism's all-reduce read from Flight Recorder, FSDP's all-gather and reduce-scatter
through the wrappers, steps and spans from the optimizer, module and autograd hooks, the mesh
from the script's DeviceMesh.
"""

from __future__ import annotations

import os

import pytest
from helpers.live import ALARMS
from helpers.paths import SCRIPTS

from analyzer.db import open_run
from analyzer.findings import analyze
from tracer.rundir import read_run_json

# A slow rank's factor: large enough that the slow rank is named however 4 ranks share 2 cores;
# that analyze reads a factor back as itself is checked on seeded synth runs
# (test_findings.py), and what it reads on live runs is measured in bench/framework_accuracy.py.
FACTOR = "2.5"


def diagnose(run: str) -> tuple[dict, object]:
    """The report, and the run still open for the test's own queries."""
    db = open_run(run)
    return analyze(db), db


def ops(db, where: str = "true") -> set[tuple]:
    got = db.sql(f'select distinct "group", op, group_size from collectives where {where}')
    return set(got.itertuples(index=False, name=None))


CASES = [
    # a sleeping slow rank (a burning one: tests/test_ddp_stragglers.py)
    ("ddp.py", ["--slow-mode", "sleep"], 1, {("dp", "all_reduce", 4)}),
    ("fsdp2_tp.py", ["--tp", "1"], 2, {("dp", "all_gather", 4), ("dp", "reduce_scatter", 4)}),
    (
        "fsdp2_tp.py",
        ["--tp", "2"],
        3,
        {("dp", "all_gather", 2), ("dp", "reduce_scatter", 2), ("tp", "all_reduce", 2)},
    ),
]


@pytest.mark.parametrize(
    ("script", "args", "slow", "want"), CASES, ids=["ddp", "fsdp2", "fsdp2_tp"]
)
@pytest.mark.solo
def test_a_slow_rank_in_an_unmodified_script_is_the_straggler(
    tmp_path, attach, script, args, slow, want
):
    run = str(tmp_path / "run")
    done = attach(run, script, *args, "--slow-rank", str(slow), "--slow-factor", FACTOR, steps=40)
    assert done.returncode == 0, done.stdout + done.stderr
    report, db = diagnose(run)
    try:
        assert want <= ops(db, "step >= 0"), ops(db)
        names = set(db.sql("select distinct name from spans where step >= 0")["name"])
        assert {"forward", "backward", "optimizer", "step", "data"} <= names
        steps = db.sql("select count(distinct step) as n from spans where name = 'step'")
        assert int(steps["n"][0]) == 40
    finally:
        db.close()
    top = report["findings"][0]
    assert (top["kind"], top["ranks"]) == ("straggler", [slow]), report["findings"]


@pytest.mark.parametrize(("script", "args"), [("ddp.py", []), ("fsdp2_tp.py", ["--tp", "2"])])
@pytest.mark.solo
def test_a_healthy_unmodified_script_raises_no_alarm(tmp_path, attach, script, args):
    run = str(tmp_path / "run")
    done = attach(run, script, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    report, db = diagnose(run)
    db.close()
    assert not [f for f in report["findings"] if f["kind"] in ALARMS], report["findings"]
    meta = read_run_json(run)
    if args:  # the script's own 2 x 2 DeviceMesh: dp outer, tp inner
        assert meta["mesh"] == {"dp": 2, "pp": 1, "tp": 2, "cp": 1}
        assert meta["coords"] == [[0, 0, 0, 0], [0, 0, 1, 0], [1, 0, 0, 0], [1, 0, 1, 0]]
        tp = sorted(g["ranks"] for g in meta["groups"] if g["name"] == "tp")
        assert tp == [[0, 1], [2, 3]]


@pytest.mark.solo
def test_a_model_with_buffers_shows_its_slow_rank_by_its_cpu_time(tmp_path, attach):
    """DDP broadcasts the model's buffers at each forward and its peers wait for the slow rank
    inside their backward: forward, backward and step read the same on every rank. Its forward
    burns FACTOR times its work: half as much CPU again in a step (the forward is a third of
    it). At the script's default 1.6x, a fifth more, its CPU time reads 1.08-1.15x its peers'
    in 22 steps on 4 ranks sharing 2 cores, under a per-step spread of 0.15-0.2 (the same work
    costs a healthy rank 42 to 62 ms of CPU a step): named in some runs, not in others."""
    script = os.path.join(SCRIPTS, "ddp_buffers.py")
    run = str(tmp_path / "slow")
    slow = ("--slow-rank", "1", "--slow-factor", FACTOR)
    done = attach(run, script, *slow, steps=24, size=())
    assert done.returncode == 0, done.stdout + done.stderr
    report, db = diagnose(run)
    db.close()
    top = report["findings"][0]
    assert (top["kind"], top["ranks"]) == ("straggler", [1]), report["findings"]
    assert top["evidence"]["cpu_ratio"] > 1.1, top
    healthy = str(tmp_path / "healthy")
    done = attach(healthy, script, steps=24, size=())
    assert done.returncode == 0, done.stdout + done.stderr
    report, db = diagnose(healthy)
    db.close()
    assert not [f for f in report["findings"] if f["kind"] in ALARMS], report["findings"]


def test_a_rank_stuck_before_its_backward_ends_the_run_and_is_named(tmp_path, attach):
    run = str(tmp_path / "run")
    done = attach(
        run, "ddp.py", "--hang-rank", "2", "--hang-step", "4", env={"MEGASCOPE_HANG_TIMEOUT": "4"}
    )
    assert done.returncode != 0  # ended by itself: the hung ranks exit after their stacks
    assert read_run_json(run)["status"] == "hung"
    report, db = diagnose(run)
    db.close()
    hangs = [f for f in report["findings"] if f["kind"] in ("hang", "crash")]
    assert [f["ranks"] for f in hangs] == [[2]], report["findings"]
    assert "Faults.backward" in hangs[0]["message"], hangs[0]["message"]
