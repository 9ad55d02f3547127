"""A rank's own time in a step, less its wait for a core (docs/spec.md §3, straggler).

``findings/rank_steps.sql`` gives each (rank, step) its step time less its waits for peers and
its data loading (``work_ns``). Where ranks share a host's cores, part of what remains is the
time the rank's thread was runnable and waited for a core (``spans.runq_ns``, summed by
``findings/rank_cpu.sql``): the scheduler ran it less, it did not work longer. That wait is
taken out here, so that a healthy rank the scheduler happened to run less (a pipeline stage's
schedule waiting for a core between its sends) reads like its peers.

The run-queue delay is the step span's, which also holds the delay to wake up at the end of a
collective (already inside the collective's time); the rank's CPU time in the step is its floor
(a thread never works less than it computed), so that counting that part twice cannot make a
rank's own time vanish. A rank slowed by sleeping or by a stalled device is not runnable in its
extra time (no wait for a core) and keeps it; one that computes more keeps it as CPU time.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.findings.common import Context, peer_reference

KEYS = ["rank", "step"]


def less_core_waits(
    ctx: Context, rows: pd.DataFrame, metric: str = "work_ns", beyond: list[str] | None = None
) -> pd.DataFrame:
    """``rows`` (one per rank and step, as ``Context.rank_steps``) with ``metric`` less the
    rank's wait for a core in the step, floored at its CPU time in it; rows the run recorded
    no such wait for are unchanged (a GPU run, a run without ``runq_ns``). With ``beyond``
    (columns of ``Context.rank_cpu``, e.g. ``["step", "pp"]``), only its wait beyond the median
    of the other ranks that share those values: the scheduler's common share stays in every
    rank's time, so that a rank's ratio to its peers keeps the scale of its wall time (a 1.5x
    rank that sleeps reads about 1.5x, not its extra time over its peers' CPU time alone)."""
    cpu = ctx.rank_cpu
    if rows.empty or cpu.empty or "runq_ns" not in cpu or cpu.runq_ns.isna().all():
        return rows
    cpu = cpu.dropna(subset=["runq_ns"]).astype({"runq_ns": float})
    # only where the rank's stage runs on one host: a rank whose peers run elsewhere and that
    # waits for a core is on an overloaded host, which is a straggler's cause
    ranks = [int(r) for r in cpu["rank"].unique()]
    ctx.prefetch_hosts(ranks)
    host = cpu["rank"].map({r: ctx.host(r) for r in ranks}).fillna("")
    one_host = host.groupby(cpu["pp"]).transform("nunique") == 1
    cpu = cpu[one_host]
    if cpu.empty:
        return rows
    if beyond:
        ref = peer_reference(cpu, beyond, "runq_ns").fillna(0.0)
        cpu = cpu.assign(runq_ns=(cpu.runq_ns - ref).clip(lower=0.0))
    got = cpu[KEYS + ["cpu_ns", "runq_ns"]]
    # a table the next two lines reindex by (rank, step), whatever order rows come in
    got = got.set_index(KEYS).astype(float)
    where = pd.MultiIndex.from_frame(rows[KEYS])
    runq = got.runq_ns.reindex(where).to_numpy()
    floor = got.cpu_ns.reindex(where).to_numpy()
    own = rows[metric].to_numpy(dtype=float)
    known = ~np.isnan(runq)
    less = np.where(known, np.maximum(own - np.nan_to_num(runq), np.nan_to_num(floor)), own)
    # never longer than it was (a CPU time past the wall time, counted on another clock)
    return rows.assign(**{metric: np.minimum(own, less)})
