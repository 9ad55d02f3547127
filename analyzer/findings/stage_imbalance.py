"""Stage imbalance: a pipeline stage whose compute is consistently longer than the others'."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.findings import own_time
from analyzer.findings.common import Context, finding, ms, peer_reference
from analyzer.findings.detector import DetectorSpec, Kind, Replay
from analyzer.findings.record import Finding


def stage_table(ctx: Context) -> pd.DataFrame:
    """Per pipeline stage (index ``pp``): steps compared ``n``, the median ``ratio`` of its
    compute to the median of the other stages' in the same step, the share of steps it was
    ``late`` (at least half the margin above), its median excess over the mean stage and its
    median compute (ns). A stage's compute in a step is the least of its ranks' own work, less
    the wait for a core where recorded. ``cpu_ratio``: the median ratio of the same over the
    CPU time of the ranks' training threads (:attr:`Context.rank_cpu`: a CPU device that counted
    it; NaN elsewhere), which the cores' sharing moves far less than it moves wall time. Empty
    with fewer than two stages or three steps."""
    th = ctx.thresholds
    rs = ctx.rank_steps
    if rs.empty or rs.pp.nunique() < 2 or ctx.n_steps < 3:
        return pd.DataFrame(
            columns=["n", "ratio", "late_frac", "excess_ns", "compute_ns", "cpu_ratio"]
        )
    rs = own_time.less_core_waits(ctx, rs)  # less the wait for a core, where recorded
    stages = _stage_steps(rs, "work_ns").rename(columns={"work_ns": "compute_ns"})
    stages["excess_ns"] = stages.compute_ns - stages.groupby("step").compute_ns.transform("mean")
    stages["late"] = stages.ratio >= 1 + th.stage_excess / 2
    table = stages.groupby("pp").agg(
        n=("ratio", "size"),
        ratio=("ratio", "median"),
        late_frac=("late", "mean"),
        excess_ns=("excess_ns", "median"),
        compute_ns=("compute_ns", "median"),
    )
    cpu = ctx.rank_cpu
    cpu_ratio = (
        _stage_steps(cpu, "cpu_ns").groupby("pp").ratio.median()
        if not cpu.empty
        else pd.Series(dtype=float)
    )
    return table.assign(cpu_ratio=cpu_ratio.reindex(table.index))


def _stage_steps(rows: pd.DataFrame, value: str) -> pd.DataFrame:
    """Per (step, stage) of the per-(rank, step) ``rows``: the stage's ``value``, the least of
    its ranks' above zero, and its ``ratio`` to the median of the other stages' in the step."""
    stages = rows[rows[value] > 0].groupby(["step", "pp"])[value].min().astype(float)
    stages = stages.reset_index()
    return stages.assign(ratio=stages[value] / peer_reference(stages, ["step"], value))


def detect(ctx: Context) -> list[Finding]:
    """Name pipeline stages that compute consistently longer than the other stages.

    Algorithm: per (step, stage), the stage's compute is the LEAST compute of its ranks (so one
    straggler inside a stage does not make the stage look slow); each stage is compared with
    the median of the other stages in the same step. A stage is imbalanced when its median
    ratio is at least 1 + ``stage_excess`` and above half that in ``persistence`` of steps.
    With one rank per stage a slow rank and a slow stage cannot be told apart; it is reported
    here.

    Severity (what-if): in a pipeline every stage runs at the pace of the slowest, so
    balancing the stages saves the slow stage's excess over the mean stage: the median per
    step of (its compute - the mean of the stages' compute), over the median step.
    """
    th = ctx.thresholds
    per = stage_table(ctx)
    rs = ctx.rank_steps
    out = []
    for pp, row in per.iterrows():
        if row.n < 3 or row.ratio < 1 + th.stage_excess or row.late_frac < th.persistence:
            continue
        ranks = sorted(int(r) for r in rs[rs.pp == pp]["rank"].unique())
        msg = (
            f"pipeline stage {int(pp)} computes {row.ratio:.2f}x as long as the other stages "
            f"({ms(row.compute_ns)} ms per step) in {round(row.late_frac * row.n)} of "
            f"{int(row.n)} steps; the whole pipeline runs at its pace"
        )
        ev = {
            "stage": int(pp),
            "compute_ratio": row.ratio,
            "compute_ms_per_step": ms(row.compute_ns),
            "excess_over_mean_ms": ms(row.excess_ns),
            "late_steps": round(row.late_frac * row.n),
            "steps_compared": int(row.n),
        }
        sev = row.excess_ns / ctx.median_step_ns
        out.append(finding(ctx, "stage_imbalance", ranks, sev, msg, ev))
    return out


def fix(replay: Replay, f: Finding) -> np.ndarray:
    """Fixed in the what-if replay: the compute of the stage's ranks."""
    return replay.stage_compute(int(f["evidence"]["stage"]))


DETECTOR = DetectorSpec("stage_imbalance", detect, (Kind("stage_imbalance", fix=fix),))
