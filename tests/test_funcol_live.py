"""The functional collectives of tensor parallelism, timed in eager mode (tracer/funcol.py).

examples/fsdp2_tp.py with ``--tp 2`` on 2 gloo ranks is ``parallelize_module`` over a DeviceMesh
(DTensor's all-reduces, issued through ``torch.distributed._functional_collectives`` and waited
for at the ``AsyncCollectiveTensor``'s first use), run unmodified under ``torchrun -m
tracer.run``. Their rows are the tracer's own (host-timed, from the rank's wait to its end), one
per collective (Flight Recorder's copies skipped), and the ranks' waits in them are recorded.
"""

from __future__ import annotations

import pytest
import torch
from helpers.live import SMALL
from helpers.tables import QUIET

import tracer
from analyzer.db import open_run

pytestmark = pytest.mark.live

STEPS = 5


def test_tensor_parallel_waits_are_timed(attach, tmp_path) -> None:
    run = str(tmp_path / "run")
    done = attach(run, "fsdp2_tp.py", "--tp", "2", nproc=2, steps=STEPS, size=SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    db = open_run(run)
    try:
        tp = db.sql(
            "select rank, source, count(*) as n, count(distinct seq) as seqs, "
            "count(distinct step) as steps, sum(end_ns - start_ns) / 1e6 as wait_ms "
            "from collectives where \"group\" = 'tp' and op = 'all_reduce' "
            "group by rank, source order by rank, source"
        )
    finally:
        db.close()
    # every tensor-parallel all-reduce is the tracer's timed row, none Flight Recorder's
    assert list(tp["source"]) == ["host", "host"], tp
    assert list(tp["steps"]) == [STEPS, STEPS], tp
    assert list(tp["n"]) == list(tp["seqs"]), tp  # one row per collective
    assert (tp["wait_ms"] > 0).all(), tp  # the ranks' waits in them are recorded


def _funcol(rank: int, world: int, run: str) -> dict:
    """Functional all-reduces on 2 ranks with the tracer attached: one waited for, rank 1 late
    to it (rank 0 waits for it), one never waited for (dropped), then the same call compiled
    with ``fullgraph=True`` (a graph break would raise)."""
    import time

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    tracer.attach(run, config=QUIET)
    pg = dist.group.WORLD
    x = torch.ones(16)
    float((funcol.all_reduce(x, "sum", pg) * 1).sum())  # warm up: a first use takes seconds
    dist.barrier()
    for step in range(3):
        tracer.step(step)
        if rank == 1:
            time.sleep(0.2)  # late to the all-reduce: rank 0 waits for it at its first use
        out = funcol.all_reduce(x, "sum", pg)
        total = float((out * 1).sum())  # the first use waits
        funcol.all_reduce(x, "sum", pg)  # dropped, never waited for

    def twice(t: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(t, "sum", pg) * 2

    tracer.step(3)  # a compiled graph's collectives are C++ ops: Flight Recorder's rows
    compiled = float(torch.compile(twice, backend="eager", fullgraph=True)(x).sum())
    tracer.close()
    return {"total": total, "compiled": compiled}


def test_a_wait_at_first_use_is_timed_once(tmp_path, ranks) -> None:
    run = str(tmp_path / "run")
    out = ranks(_funcol, 2, run)
    assert [o["total"] for o in out] == [32.0, 32.0], out
    assert [o["compiled"] for o in out] == [64.0, 64.0], out
    db = open_run(run)
    try:
        rows = db.sql(
            "select rank, step, seq, source, (end_ns - start_ns) / 1e6 as ms from collectives "
            "where op = 'all_reduce' and step between 0 and 2 order by rank, seq"
        )
    finally:
        db.close()
    assert set(rows["source"]) == {"host"}, rows
    assert len(rows) == 2 * 2 * 3 and rows.groupby("rank").seq.nunique().eq(6).all(), rows
    waited = rows[rows["rank"] == 0].iloc[::2]  # the first of each step's two
    assert (waited["ms"] > 100).all(), rows  # rank 0 waited for rank 1's sleep
    dropped = rows.iloc[1::2]
    assert (dropped["ms"] == 0).all(), rows  # never waited for: start = end
