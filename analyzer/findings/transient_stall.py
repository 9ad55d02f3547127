"""Transient stall: a rank that is occasionally late by a lot (garbage collection, a pause)."""

from __future__ import annotations

from analyzer.findings.common import Context, finding, ms, peer_reference_or, robust_sigma
from analyzer.findings.detector import DetectorSpec, Kind
from analyzer.findings.record import Finding


def detect(ctx: Context) -> list[Finding]:
    """Name ranks that stall now and then, not persistently.

    Algorithm: a rank's own time in a step is the step minus the time it spent inside
    collectives (``own_ns``): its compute, data loading and any pause, but not the waiting
    for others. A pause therefore shows on the rank that paused, while its peers' extra time
    lands in their collectives. Per (rank, step), own time minus its peers' median (same
    pipeline stage), less the rank's own median of that where positive, is the excess; a step
    is a spike when the excess is at least ``stall_share`` of the median step and ``spike_z`` robust
    sigmas above the excesses of all ranks (many rank-steps are tested, hence a wide margin). A rank with at least two spikes in at most ``transient_max_share`` of its steps has
    transient stalls (more often, it is a persistent straggler or data stall instead).

    Severity (what-if): the spikes' total excess over the total time of the analyzed steps:
    everyone waits for the stalled rank, so that time is lost on every rank.
    """
    th = ctx.thresholds
    rs = ctx.rank_steps
    if rs.empty or ctx.n_steps < 4:
        return []
    ref = peer_reference_or(rs, ["step", "pp", "cp"], ["step"], "own_ns")
    rs = rs.assign(excess_ns=rs.own_ns - ref).dropna(subset=["excess_ns"])
    if rs.empty:
        return []
    # against the rank's own typical excess, so a persistent offset is not a spike; one below
    # its peers' is not counted (with two ranks, one's excess mirrors the other's: a peer slow
    # for most of the steps would make this rank's steps before it spikes)
    typical = rs.groupby("rank").excess_ns.transform("median").clip(lower=0)
    rs = rs.assign(excess_ns=rs.excess_ns - typical)
    floor = max(th.stall_share * ctx.median_step_ns, th.spike_z * robust_sigma(rs.excess_ns))
    rs = rs.assign(spike=rs.excess_ns >= floor)
    counts = rs.groupby("rank").spike.agg(["sum", "size"])
    chosen = counts[
        (counts["sum"] >= 2) & (counts["sum"] <= th.transient_max_share * counts["size"])
    ]
    n_steps = ctx.n_steps
    out = []
    for rank, mine in rs[rs["rank"].isin(chosen.index)].groupby("rank"):
        spikes = mine[mine.spike]
        lost = float(spikes.excess_ns.sum())
        steps = sorted(int(s) for s in spikes.step)
        msg = (
            f"{ctx.label(int(rank))} stalled in {len(spikes)} of {len(mine)} steps, by "
            f"{ms(spikes.excess_ns.median())} ms (median) beyond its peers; steps {steps[:10]}"
            + ("…" if len(steps) > 10 else "")
        )
        ev = {
            "stall_steps": steps,
            "median_stall_ms": ms(spikes.excess_ns.median()),
            "max_stall_ms": ms(spikes.excess_ns.max()),
            "threshold_ms": ms(floor),
            "steps_compared": len(mine),
        }
        sev = lost / (n_steps * ctx.median_step_ns)
        out.append(finding(ctx, "transient_stall", [int(rank)], sev, msg, ev))
    return out


DETECTOR = DetectorSpec("transient_stall", detect, (Kind("transient_stall"),))
