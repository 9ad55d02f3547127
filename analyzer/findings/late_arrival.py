"""The straggler's second signal: late at the collectives that overlap its peers' backward.

DDP reduces gradients in buckets while the backward runs: each bucket's all_reduce is issued
as soon as its gradients are ready, and the backward ends only when every bucket's reduction
has. A slow rank's buckets are ready late, so its peers wait for it *inside their own
backward*, in the reduction's completion, not in a collective call of their own. Their step
time, and their forward plus backward, then equal the slow rank's, and a rank's own time
outside collectives reads the slow rank's excess only as well as the waits were estimated
(on gloo the reductions are ``untimed``: docs/spec.md §2). Where ranks share compute (a
host's cores), the peers' wait also hands the slow rank their share, and its own time reads
below its slowdown (a 2x rank burning on 4 ranks of 2 cores: about 1.4x).

What does not blur: *when* each rank arrives at those collectives, and its forward, which all
ranks run at once. The rows are the collectives a rank issued inside its own ``backward`` span
that no wrapper of the tracer saw (read from Flight Recorder, as DDP's reducer issues them
from C++; a collective called from Python shows its wait in its own row, and the own-time test
reads it): findings/overlap_arrivals.sql. Gradient accumulation under ``no_sync`` issues them
in the last microbatch's backward only. Per (rank, step):

* ``late``: its arrival at the step's last such collective minus the median of the other
  members' arrivals there (its peers' wait for it at the step's end), over the median step;
* ``forward_ratio``: its first forward pass of the step, which every rank runs at once (where
  it holds no collective, so that it is its own work), over the median of its peers';
* ``lead_ratio``: its own time from the start of its step to its first such arrival, over
  its peers' median (no rank waits before it).

A rank is named (:func:`named`) when it arrives late steadily: its median ``late`` is at least
``min_excess`` of a step, it is later than its peers' median in half of the steps at least,
and the evidence stands :data:`Z` standard errors above the noise of its peer class: the mean
of the two z-scores of ``late`` and ``forward_ratio`` times sqrt 2 (two measures of one
slowness with their own noise: the wait at the end of the step, the work at its start), or
``late``'s alone without forward spans; and its own work outside waits is longer than its
peers' too (a rank late because its data came late is a data stall, not a straggler). Its
factor is its forward ratio (where all ranks compute at once), else the larger of its lead
and own-time ratios.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analyzer.findings.common import Context, peer_reference, robust_sigma

COLUMNS = ["n", "late", "late_frac", "late_ns", "lead_ratio", "forward_ratio", "late_z",
           "forward_z", "z", "late_sigma"]  # fmt: skip
Z = 3.5  # the combined evidence, in standard errors of the peer class's noise
PERSISTENCE = 0.5  # later than its peers' median in at least half of the steps


def per_rank(ctx: Context, classes: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per rank: ``n`` steps with arrivals at overlapped collectives, the median ``late``
    share of a step and ``late_ns``, ``late_frac`` (steps it arrived after its peers' median),
    the median ``lead_ratio`` and ``forward_ratio``, their z-scores against the noise of the
    peer class (``keys``, per rank in ``classes``) and the combined ``z``. Empty where the run
    has no such collectives, or is matched in suspect groups only (``Context.at_scale``)."""
    empty = pd.DataFrame(columns=COLUMNS, dtype=float)
    if ctx.at_scale or ctx.hi < ctx.lo or not ctx.median_step_ns > 0:
        return empty
    recorded = "select 1 from collectives where source in ('untimed', 'flight_recorder') limit 1"
    if ctx.run.execute(recorded).empty:  # every collective went through the wrappers
        return empty
    rows = ctx.run.query("findings/overlap_arrivals", lo=ctx.lo, hi=ctx.hi)
    if rows.empty:
        return empty
    ref = peer_reference(rows, ["group", "gid", "seq"], "arrival_ns")
    rows = rows.assign(late=rows.arrival_ns - ref)
    rows = rows[rows.late.notna()].sort_values(["rank", "step", "arrival_ns"])
    if rows.empty:
        return empty
    g = rows.groupby(["rank", "step"], sort=False)
    steps = pd.DataFrame(
        {
            "late_ns": g.late.last(),  # at the step's last overlapped collective
            "lead_ns": g.arrival_ns.first() - g.start_ns.first(),
        }
    ).reset_index()
    steps = steps.merge(classes[keys], left_on="rank", right_index=True)
    steps["late"] = steps.late_ns / ctx.median_step_ns
    ref = peer_reference(steps, ["step", *keys], "lead_ns")
    steps["lead_ratio"] = steps.lead_ns / ref.where(ref > 0)
    steps = steps.merge(_forward_ratios(ctx, steps, keys), on=["rank", "step"], how="left")
    agg = steps.groupby("rank").agg(
        n=("late", "size"),
        late=("late", "median"),
        late_ns=("late_ns", "median"),
        late_frac=("late", lambda x: float((x > 0).mean())),
        lead_ratio=("lead_ratio", "median"),
        forward_ratio=("forward_ratio", "median"),
        n_forward=("forward_ratio", "count"),
    )
    classes_of = agg.join(classes[keys])[keys]
    for col, base, n in (("late", 0.0, "n"), ("forward_ratio", 1.0, "n_forward")):
        sigma = steps.groupby(keys)[col].apply(robust_sigma).rename("s")
        s = classes_of.join(sigma, on=keys).s
        se = 1.25 * s / np.sqrt(agg[n].clip(lower=1))
        z = (agg[col] - base) / se.where(se > 0)
        agg[f"{col.split('_')[0]}_z"] = z.where(agg[n] >= 3)
        if col == "late":
            agg["late_sigma"] = s
    both = agg.forward_z.notna()
    agg["z"] = agg.late_z.where(~both, (agg.late_z + agg.forward_z) / math.sqrt(2))
    return agg[COLUMNS]


def _forward_ratios(ctx: Context, steps: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per (rank, step): its first forward pass of the step over the median of its peers'
    (``forward_ratio``). Every rank starts it as the step's synchronization lets them go, and
    its peers are still computing while it runs; a slow rank accumulating gradients runs its
    later microbatches alone once its peers wait, on a shared host faster than with them."""
    fw = ctx.run.query("findings/overlap_forwards", lo=ctx.lo, hi=ctx.hi)
    out = pd.DataFrame(columns=["rank", "step", "forward_ratio"])
    if fw.empty:
        return out
    fw = fw.sort_values("start_ns").groupby(["rank", "step"], sort=False).head(1)
    fw = fw.merge(steps[["rank", "step", *keys]], on=["rank", "step"])
    fw["dur"] = (fw.end_ns - fw.start_ns).astype(float)
    ref = peer_reference(fw, ["step", *keys], "dur")
    fw["forward_ratio"] = fw.dur / ref.where(ref > 0)
    return fw[["rank", "step", "forward_ratio"]]


def named(ctx: Context, per_rank_work: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The ranks the second signal names (see the module docstring), with :func:`per_rank`'s
    columns and ``factor``. ``per_rank_work`` is the straggler detector's per-rank frame (its
    ``ratio``: own time outside collectives and data loading over its peers')."""
    th = ctx.thresholds
    late = per_rank(ctx, per_rank_work, keys)
    if late.empty:
        return late.assign(factor=pd.Series(dtype=float))
    ratio = per_rank_work.ratio.reindex(late.index)
    ok = (
        (late.n >= 3)
        & (late.late >= th.min_excess)
        & (late.late_frac >= PERSISTENCE)
        & (late.z >= Z)
        & (ratio >= 1.0 + th.min_excess / 2)
    )
    late = late[ok]
    lead = np.fmax(late.lead_ratio, ratio.reindex(late.index))
    return late.assign(factor=late.forward_ratio.fillna(lead))
