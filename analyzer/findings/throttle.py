"""Throttle: a GPU whose clocks are down (power, thermal) compared with its peers'."""

from __future__ import annotations

import pandas as pd

from analyzer.findings.common import Context, finding, peer_reference
from analyzer.findings.detector import DetectorSpec, Kind
from analyzer.findings.record import Finding, Note

# gpu_ranks' reason columns, as a message names them
REASONS = {
    "power_cap": "power cap",
    "hw_slowdown": "hardware slowdown",
    "sw_thermal": "thermal",
    "hw_thermal": "hardware thermal",
    "power_brake": "power brake",
}
ALL_CAPPED = 0.9  # a run-level note when this share of ranks throttles in >= a quarter of samples


def detect(ctx: Context) -> list[Finding]:
    """Name ranks whose GPU runs slower clocks or throttles while its peers do not.

    Algorithm: per rank, the median SM clock, median temperature and the share of samples
    with a throttling reason (``common.THROTTLE_MASK``) from the gpu table. A rank throttles when its
    clock is at least ``clock_drop`` below the median of the other ranks, or when at least
    half of its samples carry a throttle reason while the others' median share is under 10%.

    Severity (what-if): compute time scales with the SM clock, so restoring the peers' clock
    saves (1 - clock / peer clock) of the rank's compute time, over the median step. The
    evidence decodes the reasons (share of samples with each: power cap, hardware slowdown,
    thermal, power brake) and the clock lost. When (nearly) every GPU throttles alike, no rank
    is slower than its peers: :func:`note` says so once for the run.
    """
    th = ctx.thresholds
    g = ctx.gpu_ranks
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
        why = _reasons(row)
        msg = (
            f"{ctx.label(rank)} GPU runs at {row.sm_clock_mhz:.0f} MHz vs {row.ref_clock:.0f} MHz "
            f"on its peers ({drop:.0%} of its clock lost; {row.temp_c:.0f} °C vs "
            f"{row.ref_temp:.0f} °C); throttled in {row.throttle_frac:.0%} of samples"
            + (f": {_reasons_text(why)}" if why else "")
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
            "clock_lost_mhz": row.ref_clock - row.sm_clock_mhz,
            "clock_lost_frac": drop,
            "reasons": why,
        }
        out.append(finding(ctx, "throttle", [rank], sev, msg, ev))
    return out


def _reasons(row: pd.Series) -> dict[str, float]:
    """Reason -> share of samples, for the reasons seen."""
    return {name: round(float(row[col]), 4) for col, name in REASONS.items() if row[col] > 0}


def _reasons_text(why: dict[str, float]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in why.items())


def note(ctx: Context) -> Note | None:
    """One run-level note when (nearly) every GPU throttles: a cap on the whole job (a power
    limit, a hot room) slows every rank alike, so no finding names a rank, yet the run loses
    the clock. Evidence: the median share of samples per reason and the SM clock against the
    highest one seen."""
    g = ctx.gpu_ranks
    if len(g) < 1 or (g.throttle_frac >= 0.25).mean() < ALL_CAPPED:
        return None
    med = g.median(numeric_only=True)
    top = float(g.max_clock_mhz.max())
    lost = 1.0 - float(med.sm_clock_mhz) / top if top > 0 else 0.0
    why = _reasons(med)
    return {
        "kind": "throttle",
        "ranks": "all",
        "message": (
            f"every GPU throttles ({(g.throttle_frac >= 0.25).sum()} of {len(g)}; median "
            f"{med.throttle_frac:.0%} of samples: {_reasons_text(why)}); SM clock median "
            f"{med.sm_clock_mhz:.0f} MHz against {top:.0f} MHz at best, {lost:.0%} lost"
        ),
        "evidence": {
            "ranks_throttled": int((g.throttle_frac >= 0.25).sum()),
            "ranks": len(g),
            "throttle_share": round(float(med.throttle_frac), 4),
            "reasons": why,
            "sm_clock_mhz": float(med.sm_clock_mhz),
            "max_clock_mhz": top,
            "clock_lost_frac": round(lost, 4),
        },
    }


DETECTOR = DetectorSpec("throttle", detect, (Kind("throttle", culprit=True),))
