"""Regression: step time drifting up over the run, in a ramp or in a level shift."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from analyzer.changepoint import level_shift
from analyzer.findings.common import Context, finding, ms, robust_sigma, stage_excess
from analyzer.findings.detector import DetectorSpec, Kind
from analyzer.findings.onset import excess_of
from analyzer.findings.record import Finding, Note

# Steps after warm-up a drift needs: thirds of at least 5 steps, whose medians ignore up to two
# slow steps at either end. On a shared CPU, healthy runs of 12-15 steps (10-13 after warm-up)
# had thirds of 3-4 steps whose medians were 6-17% apart with no drift at all.
MIN_STEPS = 16
MIN_TAU = 0.5  # Kendall's tau against the step number: a steady rise, not one slow end
Z = 3.0  # the rise at least this many standard errors of the run's own noise
# a level shift: the change point (analyzer.changepoint) stands this many standard errors out,
# each side at least SHIFT_SIDE steps (their medians ignore two slow steps at an end). A step
# change reads a Kendall tau of about 0.5 (the pairs across it rise, those on one side are
# noise), so the ramp's test finds a +30% step half way through 28 steps in half the runs, and
# three quarters through in 4%; its change point reads z 8 or more in 96-100% (simulated, 5%
# noise). Healthy series wandering in phases (lag-1 autocorrelation 0.8-0.9) raise a
# regression in 3.5-5.7% of 28-step runs with it, against 3.0-4.3% with the ramp's test alone
SHIFT_Z = 8.0
SHIFT_SIDE = 5  # a level held as long as a ramp's third: a few slow steps at the end are not one
MAX_RHO = 0.9  # the largest lag-1 autocorrelation of the noise believed
# findings whose ranks' own work can lift every rank's step time (their peers wait for them:
# the registry's EXPLAINING, Kind.explains) do, when what their peers waited for them rose by this share of the step's rise
EXPLAINED_SHARE = 0.5


def _kendall_tau(y: np.ndarray) -> float:
    """Kendall's tau of ``y`` against its index: +1 when it only rises, -1 when it only falls."""
    diff = np.sign(y[None, :] - y[:, None])
    upper = np.triu_indices(len(y), k=1)
    return float(diff[upper].mean()) if len(y) > 1 else 0.0


def _theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Slope (the median of pairwise slopes) and intercept (the median of y - slope x)."""
    i, j = np.triu_indices(len(y), k=1)
    slope = float(np.median((y[j] - y[i]) / (x[j] - x[i])))
    return slope, float(np.median(y - slope * x))


def noise(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The run's own noise around its trend: (sigma, rho).

    ``sigma`` is the robust sigma (1.4826 MAD) of the residuals from Theil-Sen's line, so a
    steady drift is not counted as noise and a lone slow step does not inflate it. ``rho`` is
    the lag-1 autocorrelation of those residuals (winsorized at 3 sigma, clipped to
    [0, ``MAX_RHO``]): on a shared machine the step time wanders in phases of several steps
    (other work comes and goes), and a phase that happens to be slow at the end of a short run
    reads as a rise; correlated noise averages out slower, by sqrt((1 + rho) / (1 - rho)).
    """
    slope, intercept = _theil_sen(x, y)
    r = y - (slope * x + intercept)
    sigma = robust_sigma(r)
    if sigma <= 0 or len(r) < 4:
        return sigma, 0.0
    w = np.clip(r, -3.0 * sigma, 3.0 * sigma)
    w = w - w.mean()
    den = float(np.dot(w, w))
    rho = float(np.dot(w[:-1], w[1:])) / den if den > 0 else 0.0
    return sigma, min(max(rho, 0.0), MAX_RHO)


def drift(steps: np.ndarray, y: np.ndarray, min_drift: float) -> dict[str, Any] | None:
    """The drift up of the series ``y`` (one value per step of ``steps``, in order), or None
    (see :func:`detect` for the tests): ``shape`` ``ramp`` or ``shift``; ``first`` and
    ``last``, the levels compared (a ramp's first and last thirds' medians, a shift's medians
    before and after it); ``at``, the first step of a shift's new level (None for a ramp);
    Kendall's tau, the noise (sigma, rho), the rise in standard errors (``z``) and Theil-Sen's
    slope per step."""
    y = np.asarray(y, dtype=float)
    x = np.asarray(steps, dtype=float)
    if len(y) < MIN_STEPS:
        return None
    return _ramp(x, y, min_drift) or _shift(x, y, min_drift)


def _ramp(x: np.ndarray, y: np.ndarray, min_drift: float) -> dict[str, Any] | None:
    third = len(y) // 3
    first, last = float(np.median(y[:third])), float(np.median(y[-third:]))
    tau = _kendall_tau(y)
    if first <= 0 or last / first - 1 < min_drift or tau < MIN_TAU:
        return None
    sigma, rho = noise(x, y)
    stderr = sigma * math.sqrt(math.pi / third * (1.0 + rho) / (1.0 - rho))
    z = (last - first) / stderr if stderr > 0 else math.inf
    if z < Z:
        return None
    slope, _ = _theil_sen(x, y)
    return {
        "shape": "ramp", "first": first, "last": last, "at": None, "tau": tau, "sigma": sigma,
        "rho": rho, "z": z, "slope": slope,
    }  # fmt: skip


def _shift(x: np.ndarray, y: np.ndarray, min_drift: float) -> dict[str, Any] | None:
    shift = level_shift(y, min_side=SHIFT_SIDE)
    if shift is None or shift.before <= 0 or shift.z < SHIFT_Z:
        return None
    if shift.after / shift.before - 1 < min_drift:
        return None
    sigma, rho = noise(x, y)
    slope, _ = _theil_sen(x, y)
    return {
        "shape": "shift", "first": shift.before, "last": shift.after, "at": int(x[shift.at]),
        "tau": _kendall_tau(y), "sigma": sigma, "rho": rho, "z": shift.z, "slope": slope,
    }  # fmt: skip


def detect(ctx: Context) -> list[Finding]:
    """Report step time that grows over the run.

    Algorithm: the per-step median over ranks of the step time gives a series of n steps (the
    warm-up left out, see ``step_window``). It needs n >= ``MIN_STEPS`` (thirds of at least 5
    steps) and a rise of at least ``drift`` (the minimum size worth reporting) in one of two
    shapes:

    * a **ramp**: the median of the last third exceeds the median of the first third; the
      rise is steady (Kendall's tau against the step number >= ``MIN_TAU``, so one slow end is
      not a trend); and it stands out of the run's own noise: at least ``Z`` standard errors
      of the difference of the two medians, sigma x sqrt(pi / k x (1 + rho) / (1 - rho)) for
      thirds of k steps (the median of k normal values has a standard error of
      sqrt(pi / 2k) sigma; :func:`noise` gives sigma and rho);
    * a **level shift**: the series' change point (:func:`analyzer.changepoint.level_shift`,
      at least ``SHIFT_SIDE`` steps a side) stands ``SHIFT_Z`` standard errors out, and the
      level after it exceeds the level before.

    The slope is Theil-Sen's (median of pairwise slopes).

    A level shift is a rank's, not the run's, where one rank's lead of own work over the
    others of its stage (what they wait for it) rose across it by at least
    :data:`EXPLAINED_SHARE` of the step time's rise (:func:`_a_ranks`): a rank that turns slow
    lifts every rank's step from its onset, and the straggler's detectors judge it (before it
    is slow in enough steps to be named, a look would otherwise read its onset as a regression
    of the whole run). A ramp is the run's unless the ranks other findings name explain it
    (:func:`explained`): where every rank slows by the step, one of them may lead by more and
    more, and is named by nothing.

    Where the run recorded each step's wait for a core (``Context.rank_cpu``'s ``runq_ns``:
    ranks that share a host's cores) and the step time less that wait drifts no more, the host
    ran other work beside the job, and the job did not slow: that is :func:`note`, not a
    regression.

    Severity (what-if): had every step run at the first level's pace, the run would save
    (mean step - first level) / mean step of its time.
    """
    series, d, cause = _judged(ctx)
    if d is None or cause is not None:
        return []
    y = series.to_numpy(dtype=float)
    first, last, mean = d["first"], d["last"], float(y.mean())
    if d["shape"] == "shift":
        msg = (
            f"step time shifts up from step {d['at']}: {ms(first)} ms before, {ms(last)} ms "
            f"from there on (+{last / first - 1:.0%}, {d['z']:.1f} standard errors)"
        )
    else:
        msg = (
            f"step time drifts up: {ms(first)} ms at the start, {ms(last)} ms at the end "
            f"(+{last / first - 1:.0%}, {ms(d['slope'])} ms per step, Kendall tau {d['tau']:.2f})"
        )
    ev = {
        "shape": d["shape"],
        "first_ms": ms(first),
        "last_ms": ms(last),
        "from_step": d["at"],
        "slope_ms_per_step": ms(d["slope"]),
        "kendall_tau": d["tau"],
        "noise_ms": ms(d["sigma"]),
        "noise_autocorrelation": round(d["rho"], 3),
        "z": round(d["z"], 2) if math.isfinite(d["z"]) else None,
        "steps_compared": len(y),
    }
    steps = None if d["at"] is None else [d["at"], int(series.index[-1])]
    return [finding(ctx, "regression", [], (mean - first) / mean, msg, ev, steps=steps)]


def explained(ctx: Context, findings: list[Finding], explaining: tuple[str, ...]) -> bool:
    """Whether the ranks that other findings of the kinds ``explaining`` name (the registry's
    EXPLAINING: stragglers, data stalls, load imbalance) explain the drift. Per step, what their peers waited for them is the largest excess of
    those ranks' own work over the others' of their stage (``lost``). The drift is theirs when
    the step time less ``lost`` drifts no more, or when ``lost`` rose by at least
    :data:`EXPLAINED_SHARE` of the drift's rise between the same steps (the thirds of a ramp,
    the two sides of a shift). A straggler that begins inside the window lifts every rank's
    step from there on; that is a straggler, not a regression of the whole run. Where ranks
    share cores, its onset also changes what its peers get of them (a rank that sleeps hands
    them its core), so what is left of the rise is not a cause of its own."""
    ranks = {r for f in findings if f["kind"] in explaining for r in f["ranks"]}
    rs = ctx.rank_steps
    if not ranks or rs.empty:
        return False
    excess = stage_excess(rs, "work_ns").clip(lower=0)[rs["rank"].isin(ranks)]
    series = rs.groupby("step").step_ns.median().sort_index().astype(float)
    lost = excess.groupby(rs.step[excess.index]).max().reindex(series.index).fillna(0.0)
    steps = series.index.to_numpy()
    rest = (series - lost).clip(lower=0)
    if drift(steps, rest.to_numpy(), ctx.thresholds.drift) is None:
        return True
    d = drift(steps, series.to_numpy(), ctx.thresholds.drift)
    if d is None:
        return True
    before, after = _levels(lost, d)
    return after - before >= EXPLAINED_SHARE * (d["last"] - d["first"])


def _judged(ctx: Context) -> tuple[pd.Series, dict[str, Any] | None, Any]:
    """The per-step median step time, its drift (:func:`drift`, or None), and what explains the
    drift: ``"rank"`` where a rank's lead explains a level shift (:func:`_a_ranks`), else the
    host's load (:func:`_host_load`'s levels), else None (a regression of the run)."""
    rs = ctx.rank_steps
    if rs.empty:
        return pd.Series(dtype=float), None, None
    series = rs.groupby("step").step_ns.median().sort_index().astype(float)
    d = drift(series.index.to_numpy(), series.to_numpy(), ctx.thresholds.drift)
    if d is None:
        return series, None, None
    if d["at"] is not None and _a_ranks(ctx, series, d):
        return series, d, "rank"
    return series, d, _host_load(ctx, d)


def _a_ranks(ctx: Context, series: pd.Series, d: dict[str, Any]) -> bool:
    """Whether one rank's lead of own work over the others of its stage (what they wait for
    it, per step) rose by at least :data:`EXPLAINED_SHARE` of the drift ``d`` of ``series``
    between the same steps. A rank that turned slow leads by all of its extra time in every
    step since; on a run whose ranks all slow alike, which rank leads changes from step to
    step, and no one rank's median lead rises with the step time. The lead leaves out the
    wait for a core where the run recorded it (:func:`analyzer.findings.onset.excess_of`)."""
    # a share of the step (less the wait for a core, where recorded: a rank the host ran less
    # leads without being slower), back in ns
    lead = excess_of(ctx, "work_ns").reindex(series.index).mul(series, axis=0)
    need = EXPLAINED_SHARE * (d["last"] - d["first"])
    for rank in lead.columns:
        before, after = _levels(lead[rank].dropna(), d)
        if after - before >= need:
            return True
    return False


def _levels(series: pd.Series, d: dict[str, Any]) -> tuple[float, float]:
    """``series``' medians over the steps a drift ``d`` compares: a ramp's first and last
    thirds, a shift's two sides."""
    if d["at"] is None:
        third = len(series) // 3
        return float(series.iloc[:third].median()), float(series.iloc[-third:].median())
    return (
        float(series[series.index < d["at"]].median()),
        float(series[series.index >= d["at"]].median()),
    )


def _host_load(ctx: Context, d: dict[str, Any]) -> dict[str, Any] | None:
    """The ranks' median wait for a core (ms a step) over the levels the drift ``d`` compares,
    where the step time less that wait drifts no more; None where it does, or where the run
    recorded no such wait."""
    cpu = ctx.rank_cpu
    if cpu.empty or "runq_ns" not in cpu or cpu.runq_ns.isna().all():
        return None
    rows = ctx.rank_steps[["rank", "step", "step_ns"]].merge(
        cpu[["rank", "step", "runq_ns", "cpu_ns"]], on=["rank", "step"]
    )
    rows = rows[rows.runq_ns.notna()].astype({"step_ns": float, "runq_ns": float})
    if rows.empty:
        return None
    per_step = (
        rows.assign(rest=rows.step_ns - rows.runq_ns)
        .groupby("step")[["rest", "runq_ns", "cpu_ns"]]
        .median()
        .sort_index()
    )
    rest = per_step.rest.clip(lower=0)
    if len(per_step) < MIN_STEPS or drift(rest.index.to_numpy(), rest.to_numpy(), 0.0):
        return None
    return {
        "runq": _levels(per_step.runq_ns, d),
        "cpu": _levels(per_step.cpu_ns.astype(float), d),
    }


def note(ctx: Context, findings: list[Finding], explaining: tuple[str, ...]) -> Note | None:
    """A run-level note where the step time drifts up (as :func:`detect` tests it), neither a
    rank's lead nor the ranks that ``findings`` name explain the drift (:func:`explained`), and
    the ranks' wait for a core does (:func:`detect`): the host ran
    other work beside the job (another process, a neighbour on a shared machine), the job did
    not slow. Evidence:
    the levels of the step time, of the wait and of the training threads' CPU time a step."""
    _, d, load = _judged(ctx)
    if d is None or not isinstance(load, dict) or explained(ctx, findings, explaining):
        return None
    (q0, q1), (c0, c1) = load["runq"], load["cpu"]
    where = f"from step {d['at']}" if d["at"] is not None else "over the run"
    return {
        "kind": "host_load",
        "ranks": "all",
        "message": (
            f"step time rises {where} ({ms(d['first'])} to {ms(d['last'])} ms, "
            f"+{d['last'] / d['first'] - 1:.0%}) with the ranks' wait for a core ({ms(q0)} to "
            f"{ms(q1)} ms a step), their CPU time a step {ms(c0)} to {ms(c1)} ms: the host ran "
            "other work beside the job; the job did not slow"
        ),
        "evidence": {
            "shape": d["shape"],
            "from_step": d["at"],
            "first_ms": ms(d["first"]),
            "last_ms": ms(d["last"]),
            "runq_first_ms": ms(q0),
            "runq_last_ms": ms(q1),
            "cpu_first_ms": ms(c0),
            "cpu_last_ms": ms(c1),
        },
    }


DETECTOR = DetectorSpec("regression", detect, (Kind("regression"),))
