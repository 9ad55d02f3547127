"""Throttle: a GPU whose clocks are down (power, thermal) compared with its peers'."""

from __future__ import annotations

from typing import Any

from analyzer.findings.common import Context, finding, peer_reference

# NVML clock-event reasons that slow a busy GPU: SW power cap (0x4), HW slowdown (0x8),
# SW thermal (0x20), HW thermal (0x40), HW power brake (0x80). Idle (0x1) and application
# clock settings (0x2) are not faults.
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def detect(ctx: Context) -> list[dict[str, Any]]:
    """Name ranks whose GPU runs slower clocks or throttles while its peers do not.

    Algorithm: per rank, the median SM clock, median temperature and the share of samples
    with a throttling reason (``THROTTLE_MASK``) from the gpu table. A rank throttles when its
    clock is at least ``clock_drop`` below the median of the other ranks, or when at least
    half of its samples carry a throttle reason while the others' median share is under 10%.

    Severity (what-if): compute time scales with the SM clock, so restoring the peers' clock
    saves (1 - clock / peer clock) of the rank's compute time, over the median step.
    """
    th = ctx.thresholds
    g = ctx.run.query("findings/gpu_ranks", mask=THROTTLE_MASK)
    if len(g) < 2:
        return []
    g = g.assign(
        ref_clock=peer_reference(g.assign(k=0), ["k"], "sm_clock_mhz"),
        ref_frac=peer_reference(g.assign(k=0), ["k"], "throttle_frac"),
        ref_temp=peer_reference(g.assign(k=0), ["k"], "temp_c"),
    )
    rs = ctx.rank_steps
    compute = rs.groupby("rank").compute_ns.median() if not rs.empty else None
    g["drop"] = (1 - g.sm_clock_mhz / g.ref_clock.where(g.ref_clock > 0)).fillna(0.0)
    reasons = (g.throttle_frac >= 0.5) & (g.ref_frac < 0.1)
    out = []
    for _, row in g[(g["drop"] >= th.clock_drop) | reasons].iterrows():
        drop = row["drop"]
        rank = int(row["rank"])
        c = float(compute.get(rank, 0.0)) if compute is not None else 0.0
        sev = (
            max(drop, 0.0) * c / ctx.median_step_ns
            if ctx.median_step_ns == ctx.median_step_ns
            else 0.0
        )
        msg = (
            f"{ctx.label(rank)} GPU runs at {row.sm_clock_mhz:.0f} MHz vs {row.ref_clock:.0f} MHz "
            f"on its peers ({row.temp_c:.0f} °C vs {row.ref_temp:.0f} °C); throttling reasons in "
            f"{row.throttle_frac:.0%} of samples"
        )
        ev = {
            "sm_clock_mhz": row.sm_clock_mhz,
            "peer_sm_clock_mhz": row.ref_clock,
            "temp_c": row.temp_c,
            "peer_temp_c": row.ref_temp,
            "throttle_share": row.throttle_frac,
            "peer_throttle_share": row.ref_frac,
            "power_w": row.power_w,
            "samples": int(row.samples),
        }
        out.append(finding(ctx, "throttle", [rank], sev, msg, ev))
    return out
