"""A spread load imbalance must show in the ranks' CPU time where the run counted it.

Four gloo ranks of a Hugging Face Trainer run on 2 cores (tests/data/cpu_runs, README there):
the scheduler lengthens one rank's compute in one step and another's in the next, 8-12% of a
step spread over every rank. Plain DDP has one unit of compute per replica and step, so the
replica check of the spread ``load_imbalance`` cannot tell that from work given unevenly; the
training thread's CPU time can: scheduling does not lengthen it, uneven work does. Before this
check, 4 of 6 healthy runs of the script read a ``load_imbalance`` on all four ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.paths import DATA

from analyzer.db import open_run
from analyzer.findings import analyze, step_window
from analyzer.findings.common import Context
from analyzer.findings.severity.cost import IMBALANCE_MIN
from analyzer.findings.spread_imbalance import cpu_spread

RUNS = Path(DATA) / "cpu_runs"


def _report_and_spread(run) -> tuple[dict, float | None]:
    db = open_run(str(run))
    try:
        lo, hi = step_window(db, None)
        return analyze(db), cpu_spread(Context(db, lo, hi))
    finally:
        db.close()


def _cpu_follows_work(run) -> None:
    """The run rewritten as if each rank's CPU time in a step were its own work in it (its
    time outside waits): every bit of the spread is work given."""
    db = open_run(str(run))
    try:
        lo, hi = step_window(db, None)
        work = Context(db, lo, hi).rank_steps.set_index(["rank", "step"]).work_ns
    finally:
        db.close()
    for part in sorted((run / "spans").glob("rank=*/*.parquet")):
        rank = int(part.parent.name.split("=")[1])
        table = pq.read_table(part)
        rows = table.to_pandas()
        steps = rows.name.eq("step") & rows.step.between(lo, hi)
        rows.loc[steps, "cpu_ns"] = [int(work[(rank, s)]) for s in rows.step[steps]]
        cpu = pa.array(rows.cpu_ns.astype("Int64"), type=pa.int64())
        pq.write_table(
            table.set_column(table.schema.get_field_index("cpu_ns"), "cpu_ns", cpu), part
        )


def test_a_healthy_runs_scheduling_noise_is_no_load_imbalance():
    report, spread = _report_and_spread(RUNS / "hf_trainer_healthy")
    assert spread is not None and spread < IMBALANCE_MIN
    assert report["findings"] == [], [f["message"] for f in report["findings"]]


def test_the_same_spread_in_cpu_time_is_a_load_imbalance(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUNS / "hf_trainer_healthy", run)
    _cpu_follows_work(run)
    report, spread = _report_and_spread(run)
    assert spread is not None and spread >= IMBALANCE_MIN
    kinds = [(f["kind"], f["ranks"]) for f in report["findings"]]
    assert kinds == [("load_imbalance", [0, 1, 2, 3])], kinds


def test_a_slow_rank_is_still_named_on_the_same_script():
    report, spread = _report_and_spread(RUNS / "hf_trainer_slow1")
    assert spread is not None and spread >= IMBALANCE_MIN  # the slow rank's burn is CPU time
    top = report["findings"][0]
    assert (top["kind"], top["ranks"]) == ("straggler", [1])


@pytest.mark.parametrize(
    ("name", "first"),
    [
        ("hf_trainer_healthy", ("load_imbalance", [0, 1, 2, 3])),
        ("hf_trainer_slow1", ("straggler", [1])),
    ],
)
def test_without_cpu_time_the_spread_is_judged_by_the_replay_alone(tmp_path, name, first):
    """The same runs with no CPU time counted (as on a GPU, whose spans the device times): no
    CPU check, and the healthy run's scheduling reads as the spread imbalance, as before."""
    run = tmp_path / "run"
    shutil.copytree(RUNS / name, run)
    for part in (run / "spans").glob("rank=*/*.parquet"):
        table = pq.read_table(part)
        i = table.schema.get_field_index("cpu_ns")
        pq.write_table(table.set_column(i, "cpu_ns", pa.nulls(len(table), pa.int64())), part)
    report, spread = _report_and_spread(run)
    assert spread is None
    top = report["findings"][0]
    assert (top["kind"], top["ranks"]) == first
