"""Offload stall: steps that wait for optimizer-offload traffic the forward did not hide."""

from __future__ import annotations

from typing import Any

import pandas as pd

from analyzer.findings.common import Context, finding, ms
from analyzer.findings.detector import DetectorSpec, Kind
from analyzer.findings.record import Finding

SPLIT_FINER = 2  # "more interleaving": buckets this many times smaller


def detect(ctx: Context) -> list[Finding]:
    """Name the ranks whose steps wait on offloaded optimizer traffic, and what it costs.

    Algorithm: per (rank, step) (``Context.offload``), ``wait_ns`` is the time the training thread spent in
    ``offload_wait`` spans: waiting for a bucket's parameters to come back from the host
    update before the forward uses them (or for the gradients to have gone down). A rank
    stalls when its median wait per step is at least ``stall_share`` of the median step and
    it waits that half of it or more in ``persistence`` of the steps.

    Cost, as a what-if in which the copies and host updates are fully overlapped (no wait):
    each step would be shorter by the longest wait of any rank in it (its peers wait for that
    rank in the gather of the same bucket), never more than the step. Severity: those savings
    over the analyzed steps' time.

    What would hide it: the traffic and host update that the forward hid is their time less
    the wait; with ``optimizer_offload`` scaled to ``fraction * hidden / total`` they would
    fit (``hide_with_fraction``); buckets ``SPLIT_FINER`` times smaller interleave the copies
    with more of the forward (``hide_with_bucket_size_mb``), since the first layers then wait
    for a smaller first bucket.
    """
    df = ctx.offload
    rs = ctx.all_rank_steps
    if df.empty or rs.empty or ctx.n_steps < 3:
        return []
    th = ctx.thresholds
    floor = th.stall_share * ctx.median_step_ns
    per_rank = (
        df.assign(late=df.wait_ns >= floor / 2)
        .groupby("rank")
        .agg(
            n=("late", "size"),
            late_frac=("late", "mean"),
            wait_ns=("wait_ns", "median"),
            d2h_ns=("d2h_ns", "median"),
            update_ns=("update_ns", "median"),
            h2d_ns=("h2d_ns", "median"),
            d2h_bytes=("d2h_bytes", "median"),
        )
    )
    flagged = per_rank[
        (per_rank.n >= 3) & (per_rank.wait_ns >= floor) & (per_rank.late_frac >= th.persistence)
    ]
    if flagged.empty:
        return []
    step_ns = rs.groupby("step").step_ns.median().astype(float)
    held = df.groupby("step").wait_ns.max().reindex(step_ns.index, fill_value=0).astype(float)
    saved = held.clip(upper=step_ns)
    severity = float(saved.sum() / step_ns.sum()) if step_ns.sum() > 0 else 0.0
    return [_finding(ctx, flagged, step_ns, saved, severity)]


def _finding(
    ctx: Context, flagged: pd.DataFrame, step_ns: pd.Series, saved: pd.Series, severity: float
) -> Finding:
    meta = ctx.run.meta.get("train")
    train: dict[str, Any] = meta if isinstance(meta, dict) else {}
    fraction = float(train.get("optimizer_offload") or 0.0)
    bucket_mb = train.get("bucket_size_mb")
    worst = flagged.sort_values("wait_ns", ascending=False).iloc[0]
    traffic = float(worst.d2h_ns + worst.update_ns + worst.h2d_ns)
    hidden = max(0.0, traffic - float(worst.wait_ns))
    ev: dict[str, Any] = {
        "stall_ms_per_step": ms(float(worst.wait_ns)),
        "stall_steps": round(float(worst.late_frac * worst.n)),
        "steps_compared": int(worst.n),
        "step_ms": ms(float(step_ns.median())),
        "whatif_step_ms": ms(float((step_ns - saved).median())),
        "saved_ms_per_step": ms(float(saved.median())),
        "lost_s_per_hour": round(severity * 3600, 1),
        "d2h_ms": ms(float(worst.d2h_ns)),
        "host_update_ms": ms(float(worst.update_ns)),
        "h2d_ms": ms(float(worst.h2d_ns)),
        "bytes_per_step": int(worst.d2h_bytes),
        "hidden_share": round(hidden / traffic, 3) if traffic > 0 else None,
        "by_rank_stall_ms": {int(r): ms(float(w)) for r, w in flagged.wait_ns.items()},
        "fraction": fraction or None,
        "hide_with_fraction": round(fraction * hidden / traffic, 3)
        if fraction and traffic > 0
        else None,
        "hide_with_bucket_size_mb": round(float(bucket_mb) / SPLIT_FINER, 3) if bucket_mb else None,
    }
    ranks = [int(r) for r in flagged.index]
    names = ", ".join(ctx.label(r) for r in ranks)
    hide = (
        f"offloading {ev['hide_with_fraction']:g} instead of {fraction:g} of the state"
        if ev["hide_with_fraction"] is not None
        else "offloading a smaller share of the state"
    )
    msg = (
        f"{names} waits {ev['stall_ms_per_step']:g} ms per step for offloaded optimizer traffic "
        f"(copies down {ev['d2h_ms']:g} ms, host update {ev['host_update_ms']:g} ms, copies up "
        f"{ev['h2d_ms']:g} ms; the forward hid {round(100 * (ev['hidden_share'] or 0))}%): fully "
        f"overlapped, a step would take {ev['whatif_step_ms']:g} ms instead of "
        f"{ev['step_ms']:g} ms; {hide}, or smaller buckets interleaving the copies with more of "
        f"the forward, would hide it"
    )
    return finding(ctx, "offload_stall", ranks, severity, msg, ev)


DETECTOR = DetectorSpec("offload_stall", detect, (Kind("offload_stall"),))
