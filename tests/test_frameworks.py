"""Scripts written with a training framework, traced unmodified on 4 gloo ranks and diagnosed.

examples/hf_trainer.py (Hugging Face's Trainer), lightning_ddp.py (Lightning's DDP strategy) and
accelerate_loop.py (a loop through accelerate's Accelerator) know nothing of megascope: the
framework drives the loop, wraps the model in DDP and creates the process group. Each runs as
``torchrun --nproc-per-node 4 -m tracer.run examples/SCRIPT``. A slow rank burns real compute in
its transformer blocks (examples/slowdown.py), as a slow GPU's peers would see it, at a
different rank and factor in each framework; DDP's bucketed all_reduce overlaps the backward, so
its peers wait for it inside their own backward. The frameworks come with the ``frameworks``
extra; a missing one skips its tests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from distributed import free_port
from test_examples import SMALL

from analyzer.db import open_run
from analyzer.findings import analyze

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALARMS = {"straggler", "slow_link", "hang", "crash", "regression"}
STEPS = 30
FRAMEWORK = {
    "hf_trainer.py": "transformers",
    "lightning_ddp.py": "lightning",
    "accelerate_loop.py": "accelerate",
}


# A slow rank's runs take a model between the examples' default and the smallest one: at the
# smallest a block's forward takes a few ms, as long as the scheduler's slices where 4 ranks share
# 2 cores, and a rank 1.6x slow read anywhere from 1.4x to (once) nothing beyond the noise
MID = ("--dim", "192", "--layers", "2", "--seq", "96")


def trace(
    run: str, script: str, *args: str, size: tuple[str, ...] = SMALL
) -> subprocess.CompletedProcess:
    pytest.importorskip(FRAMEWORK[script])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
           f"--master-port={free_port()}", "-m", "tracer.run",
           os.path.join(ROOT, "examples", script), "--steps", str(STEPS), *size, *args]  # fmt: skip
    env = {**os.environ, "MEGASCOPE_TRACE": run, "PYTHONPATH": ROOT}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=270)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def attached(run: str) -> dict:
    """What the tracer found by itself, checked; the diagnosis."""
    db = open_run(run)
    try:
        steps = db.sql(
            "select rank, count(distinct step) as n from spans where name = 'step' group by rank"
        )
        assert dict(zip(steps["rank"], steps["n"], strict=True)) == dict.fromkeys(range(4), STEPS)
        names = set(db.sql("select distinct name from spans where step >= 0")["name"])
        assert {"forward", "backward", "optimizer", "step"} <= names, names
        # DDP's gradient all_reduce, read from Flight Recorder: every rank, every step
        ddp = db.sql(
            "select rank, count(distinct step) as n from collectives "
            "where op = 'all_reduce' and step >= 0 and group_size = 4 group by rank"
        )
        assert dict(zip(ddp["rank"], ddp["n"], strict=True)) == dict.fromkeys(range(4), STEPS)
        # the optimizer span is the update alone, also where the framework runs the forward
        # and backward inside optimizer.step(closure) (Lightning)
        inside = db.sql(
            "select count(*) as n from spans o join spans c using (rank, step) "
            "where o.name = 'optimizer' and c.name in ('forward', 'backward') "
            "and o.start_ns < c.end_ns and c.start_ns < o.end_ns"
        )
        assert int(inside["n"][0]) == 0
        return analyze(db)
    finally:
        db.close()


def explain(report: dict, run: str | None = None) -> str:
    """The findings, and where there are none, what each rank's steps looked like."""
    lines = [f"{f['kind']} {f['ranks']}: {f['message']}" for f in report["findings"]]
    lines += [f"dismissed: {d}" for d in report.get("dismissed", [])]
    if not lines and run is not None:
        db = open_run(run)
        try:
            lines.append(db.sql(
                "select rank, name, count(*) as n, median(end_ns - start_ns) / 1e6 as median_ms "
                "from spans where step >= 2 group by rank, name order by name, rank"
            ).to_string())  # fmt: skip
        finally:
            db.close()
    return "\n".join(lines) or "no findings"


# Hugging Face's GPT-2 computes its loss inside its forward, so its blocks are a smaller share of
# the forward the tracer times: the largest factor there
SLOW = [("hf_trainer.py", 1, 1.8), ("lightning_ddp.py", 3, 1.5), ("accelerate_loop.py", 0, 1.6)]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "rank", "factor"), SLOW, ids=lambda v: str(v))
def test_a_framework_run_names_its_slow_rank_and_its_factor(tmp_path, script, rank, factor):
    run = str(tmp_path / "run")
    trace(run, script, "--slow-rank", str(rank), "--slow-factor", str(factor), size=MID)
    report = attached(run)
    assert report["findings"], explain(report, run)
    top = report["findings"][0]
    assert (top["kind"], top["ranks"]) == ("straggler", [rank]), explain(report)
    ratio = top["evidence"]["work_ratio"]
    assert abs(ratio / factor - 1) <= 0.25, (ratio, explain(report))


# The healthy run at the fault runs' size: at the smallest, where a forward lasts a few of the
# scheduler's slices, one healthy rank read 1.24x slow through all 28 steps in one CI run, as
# slow as a rank burning to 1.3x reads; at this size the healthy ranks' forwards read 0.99-1.18x
@pytest.mark.slow
def test_a_healthy_framework_run_raises_no_alarm(tmp_path):
    run = str(tmp_path / "run")
    trace(run, "accelerate_loop.py", size=MID)
    report = attached(run)
    assert not [f for f in report["findings"] if f["kind"] in ALARMS], explain(report)
