"""Regression: step time drifting up over the run."""

from __future__ import annotations

from typing import Any

import numpy as np

from analyzer.findings.common import Context, finding, ms

MIN_STEPS = 9


def _kendall_tau(y: np.ndarray) -> float:
    """Kendall's tau of ``y`` against its index: +1 when it only rises, -1 when it only falls."""
    diff = np.sign(y[None, :] - y[:, None])
    upper = np.triu_indices(len(y), k=1)
    return float(diff[upper].mean()) if len(y) > 1 else 0.0


def detect(ctx: Context) -> list[dict[str, Any]]:
    """Report step time that grows over the run.

    Algorithm: the per-step median over ranks of the step time gives a series. It drifts up
    when the median of its last third exceeds the median of its first third by ``drift`` and
    the rise is steady (Kendall's tau against the step number >= 0.5, so one slow step at the
    end is not a trend). The slope is Theil-Sen's (median of pairwise slopes). At least
    ``MIN_STEPS`` steps are needed.

    Severity (what-if): had every step run at the first third's pace, the run would save
    (mean step - first third's median) / mean step of its time.
    """
    th = ctx.thresholds
    rs = ctx.rank_steps
    if rs.empty:
        return []
    series = rs.groupby("step").step_ns.median().sort_index()
    if len(series) < MIN_STEPS:
        return []
    y = series.to_numpy(dtype=float)
    x = series.index.to_numpy(dtype=float)
    third = len(y) // 3
    first, last = float(np.median(y[:third])), float(np.median(y[-third:]))
    tau = _kendall_tau(y)
    if first <= 0 or last / first - 1 < th.drift or tau < 0.5:
        return []
    i, j = np.triu_indices(len(y), k=1)
    slope = float(np.median((y[j] - y[i]) / (x[j] - x[i])))
    mean = float(y.mean())
    msg = (
        f"step time drifts up: {ms(first)} ms at the start, {ms(last)} ms at the end "
        f"(+{last / first - 1:.0%}, {ms(slope)} ms per step, Kendall tau {tau:.2f})"
    )
    ev = {
        "first_third_ms": ms(first),
        "last_third_ms": ms(last),
        "slope_ms_per_step": ms(slope),
        "kendall_tau": tau,
        "steps_compared": len(y),
    }
    return [finding(ctx, "regression", [], (mean - first) / mean, msg, ev)]
