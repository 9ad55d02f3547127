"""A slow rank under DDP's overlapped gradient reduction, named from when it arrives.

examples/ddp.py on 4 gloo ranks, traced unmodified, its slow rank burning real compute in its
transformer blocks (examples/slowdown.py: it contends for the cores with its peers, as a slow
GPU's extra time does from theirs, rather than sleeping). Its peers wait for it inside their own
backward, where DDP's bucketed all_reduces complete, so the step and forward plus backward
read the same on every rank; the straggler is named from its late arrival at those
all_reduces and its own work (analyzer/findings/late_arrival.py). 40 steps: on 2 shared cores
one step's timing varies by 20-30%.
"""

from __future__ import annotations

import json
import os

import pytest
from test_examples import ALARMS, diagnose, trace

STEPS = 40


def report_of(tmp_path, *args: str) -> dict:
    run = str(tmp_path / "run")
    done = trace(run, "ddp.py", *args, steps=STEPS)
    assert done.returncode == 0, done.stdout + done.stderr
    report, db = diagnose(run)
    db.close()
    return report


def shown(report: dict) -> str:
    return json.dumps({k: report[k] for k in ("run", "findings", "dismissed")}, indent=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("slow", "factor", "accum"), [(3, 2.0, 1), (1, 1.7, 2)], ids=["rank3-2x", "rank1-1.7x-accum2"]
)
def test_a_burning_rank_under_ddp_is_named_with_its_factor(tmp_path, slow, factor, accum):
    report = report_of(
        tmp_path, "--slow-rank", str(slow), "--slow-factor", str(factor), "--accum", str(accum)
    )
    top = report["findings"][0] if report["findings"] else {}
    assert (top.get("kind"), top.get("ranks")) == ("straggler", [slow]), shown(report)
    ev = top["evidence"]
    assert ev["signal"] == "late_arrival", shown(report)
    assert 0.8 * factor <= ev["work_ratio"] <= 1.2 * factor, shown(report)
    assert ev["late_ms_per_step"] > 0 and ev["late_arrival_steps"] >= ev["arrival_steps"] / 2
    # what fixing it saves: the time its peers wait for it, a few percent of a step at least
    assert 0.02 <= top["severity"] <= 0.6, shown(report)
    assert f"rank {slow}" in top["message"] and "inside their own backward" in top["message"]


@pytest.mark.slow
def test_a_healthy_ddp_run_names_no_one(tmp_path):
    report = report_of(tmp_path, "--accum", "2")
    alarms = [f for f in report["findings"] if f["kind"] in ALARMS | {"regression"}]
    assert not alarms, shown(report)
    assert os.path.isdir(tmp_path / "run" / "collectives")
