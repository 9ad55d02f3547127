"""Data stall: a rank whose data loading is persistently longer than its peers'."""

from __future__ import annotations

from analyzer.findings.common import Context, finding, ms, peer_reference_or
from analyzer.findings.detector import DetectorSpec, Kind
from analyzer.findings.record import Finding


def detect(ctx: Context) -> list[Finding]:
    """Name ranks whose `data` spans take persistently longer than their peers'.

    Algorithm: per (rank, step), the rank's time in spans of kind ``data`` minus the median
    of its peers in that step (same pipeline stage and context shard; all ranks when it has no
    such peer). A rank stalls on data when that excess is at least ``stall_share`` of the
    median step in the median step and above half of it in ``persistence`` of the steps.

    Severity (what-if): the median excess per step over the median step. Its peers wait for
    it at the next collective, so the excess is on the critical path.
    """
    th = ctx.thresholds
    rs = ctx.rank_steps
    if rs.empty or ctx.n_steps < 3 or not (rs.data_ns > 0).any():
        return []
    ref = peer_reference_or(rs, ["step", "pp", "cp"], ["step"], "data_ns")
    rs = rs.assign(excess_ns=rs.data_ns - ref).dropna(subset=["excess_ns"])
    floor = th.stall_share * ctx.median_step_ns
    per_rank = (
        rs.assign(late=rs.excess_ns >= floor / 2)
        .groupby("rank")
        .agg(
            n=("late", "size"),
            late_frac=("late", "mean"),
            excess_ns=("excess_ns", "median"),
            data_ns=("data_ns", "median"),
        )
    )
    flagged = per_rank[
        (per_rank.n >= 3) & (per_rank.excess_ns >= floor) & (per_rank.late_frac >= th.persistence)
    ]
    out = []
    for rank, row in flagged.iterrows():
        peer_ms = ms(row.data_ns - row.excess_ns)
        msg = (
            f"{ctx.label(int(rank))} spends {ms(row.excess_ns)} ms more per step loading data "
            f"than its peers ({ms(row.data_ns)} ms vs {peer_ms} ms) in "
            f"{round(row.late_frac * row.n)} of {int(row.n)} steps"
        )
        ev = {
            "data_ms_per_step": ms(row.data_ns),
            "peer_data_ms_per_step": peer_ms,
            "excess_ms_per_step": ms(row.excess_ns),
            "late_steps": round(row.late_frac * row.n),
            "steps_compared": int(row.n),
        }
        out.append(
            finding(ctx, "data_stall", [int(rank)], row.excess_ns / ctx.median_step_ns, msg, ev)
        )
    return out


DATA_STALL = Kind("data_stall", persistent=True, measure="data_ns", culprit=True, explains=True)
DETECTOR = DetectorSpec("data_stall", detect, (DATA_STALL,))
