"""Lasting faults that began inside the window: a rank that turns slow part way through it.

The detectors that compare ranks step by step want a rank slow in most of the window's steps
(a straggler's persistence): one that turns slow in its last quarter, or half way through a
long run, reads as a transient stall, or as nothing. Here each rank's series of excess of own
work (less its wait for a core, where the run recorded it: :func:`excess_of`) over its stage's
other ranks' median (:func:`excess_frame`, a share of the step) is searched for a level shift
up (:mod:`analyzer.changepoint`) that leaves at least :data:`MIN_AFTER` steps after it and
fewer than the window's detectors need (:func:`onsets`); the steps from the earliest such shift on
are analyzed again, and the stragglers and data stalls found there among those ranks are the
window's findings too, with their steps. The transient stall of the same ranks in those steps
was their first steps, and goes (one fault, one finding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzer.changepoint import Shift, level_shift, split_at
from analyzer.duck import EXACT_MAX_RANKS
from analyzer.findings.common import Context, Thresholds, peer_reference, stage_excess
from analyzer.findings.record import Finding

MIN_AFTER = 3  # steps of a fault's new level before it is named from them alone
# a level shift dates a fault a finding names when it stands this many standard errors out;
# it makes a rank a suspect by itself at ONSET_Z: the largest of a rank's splits, over every
# rank, reads up to 4.8 on healthy runs of shared cores (the best of many tries), a real onset
# tens to hundreds
SHIFT_Z = 3.0
ONSET_Z = 6.0
# a rank whose excess rose by this share of the run's rise in step time, where the step time
# shifted up, led that rise (onsets)
LEADS = 0.5


def excess_frame(rs: pd.DataFrame, measure: str) -> pd.DataFrame:
    """Per step (rows) and rank (columns) of a ``rank_steps`` frame: the rank's excess of
    ``measure`` over the median of its stage's other ranks in the step, as a share of the
    step's median time."""
    if rs.empty:
        return pd.DataFrame(dtype=float)
    step = rs.groupby("step").step_ns.transform("median").astype(float)
    share = (stage_excess(rs, measure) / step.where(step > 0)).replace([np.inf, -np.inf], np.nan)
    return _wide(rs.assign(share=share), "share")


def _wide(rs: pd.DataFrame, column: str) -> pd.DataFrame:
    """``column`` of ``rs`` per step (rows, sorted) and rank (columns): the mean where a (step,
    rank) has several rows (as a pivot table, in a tenth of its time: a watch's pulse runs it
    at each new step)."""
    return rs.groupby(["step", "rank"])[column].mean().unstack("rank").sort_index()


def excess_of(ctx: Context, measure: str) -> pd.DataFrame:
    """:func:`excess_frame` of ``ctx``'s steps. For own work (``work_ns``), where the run
    recorded each step's wait for a core (``Context.rank_cpu``'s ``runq_ns``: ranks that share
    a host's cores), that wait is left out of it: it is time the host's scheduler gave to
    others, not time of the rank's own work. On 2 gloo ranks sharing 2 cores with their
    tracers' flushes, it is most of their own time's noise from step to step (a rank's excess
    over the other read -0.38 to +0.26 of a step before a fault; less its wait, -0.11 to
    +0.09), and a slow rank's sleep or extra compute is none of it."""
    rs = ctx.rank_steps
    if measure != "work_ns" or rs.empty:
        return excess_frame(rs, measure)
    cpu = ctx.rank_cpu
    if cpu.empty or "runq_ns" not in cpu or cpu.runq_ns.isna().all():
        return excess_frame(rs, measure)
    runq = cpu.set_index(["rank", "step"]).runq_ns.astype(float)
    waited = runq.reindex(pd.MultiIndex.from_frame(rs[["rank", "step"]])).fillna(0.0).to_numpy()
    own = (rs.work_ns.astype(float) - waited).clip(lower=0)
    return excess_frame(rs.assign(own_ns=own), "own_ns")


def onsets(ctx: Context) -> dict[int, int]:
    """Rank -> the step its own work shifted up at, for the ranks that turned slow too late in
    the window for its detectors (module docstring). Up to ``EXACT_MAX_RANKS`` ranks; a rank is
    searched only where three steps in a row of it read ``min_excess`` above its peers (a cheap
    screen). A rank's shift is its onset where either

    * it stands :data:`ONSET_Z` standard errors out by itself, or
    * the run's step time (the median over ranks, step by step) shifted up there by
      :data:`ONSET_Z` standard errors, and the rank's excess shifted up at the same step by
      :data:`SHIFT_Z` and by :data:`LEADS` of the step time's rise or more: it led the run's
      slowdown.

    The second reads a fault that slows the run from its first few steps, where a rank's
    excess alone is too noisy to: where ranks share cores, a rank's own time swings by a
    fifth of a step from step to step with the cores' contention (a rank computes faster while
    its peer waits), and three steps of a 2x rank stood 3.9-9.6 standard errors out over four
    runs, while the step time, which both ranks' contention moves alike, shifted by 7.7-10. On healthy runs of
    shared cores the step time shifts too (the host's load: 6.4 at most over 80 looks of four
    dp2 runs), but no rank's excess leads it (a quarter of its rise at most)."""
    th = ctx.thresholds
    if ctx.run.world_size > EXACT_MAX_RANKS or ctx.n_steps < 2 * MIN_AFTER:
        return {}
    step = ctx.rank_steps.groupby("step").step_ns.median().sort_index().astype(float)
    found = {}
    for rank, (x, shift) in shifts(excess_of(ctx, "work_ns"), step, th.min_excess).items():
        if len(x) - shift.at < th.persistence * len(x):  # else the window's detectors see it
            found[rank] = int(x.index[shift.at])
    return found


def shifts(
    frame: pd.DataFrame, step: pd.Series, min_excess: float
) -> dict[int, tuple[pd.Series, Shift]]:
    """Rank -> (its excess series, its level shift up) for the ranks of ``frame``
    (:func:`excess_frame`: steps x ranks) whose shift is an onset by :func:`onsets`' two rules,
    wherever in the series it falls; ``step``: the run's step time by step (ns, the median over
    ranks)."""
    screened = frame.rolling(MIN_AFTER).median().max() >= min_excess
    slowed = level_shift(step.to_numpy(), min_side=MIN_AFTER)
    if slowed is not None and not (slowed.z >= ONSET_Z and slowed.after > slowed.before):
        slowed = None
    found = {}
    for rank in frame.columns[screened.to_numpy()]:
        x = frame[rank].dropna()
        shift = level_shift(x.to_numpy(), min_side=MIN_AFTER)
        if shift is None:
            continue
        if not (shift.z >= ONSET_Z and shift.after - shift.before >= min_excess):
            shift = _led(x, step, slowed, min_excess) if slowed is not None else None
            if shift is None:
                continue
        found[int(rank)] = (x, shift)
    return found


@dataclass(frozen=True)
class Turn:
    """A rank that turned slow inside a window of steps and stayed slow (:func:`turned`)."""

    rank: int
    at: int  # the step its own work shifted up at
    steps: int  # the steps from it on
    factor: float  # its own work over its peers' since (median)
    share: float  # its excess over its peers' since, a share of the step (median)
    z: float  # the shift, in standard errors


def turned(rs: pd.DataFrame, th: Thresholds) -> list[Turn]:
    """The ranks of ``rs`` (rank_steps rows: ``rank, step, pp, step_ns, work_ns``) whose own
    work shifted up inside it by :func:`onsets`' rules (:func:`shifts`) and stayed up: from the
    shift on, by ``min_excess`` in the median and by half of it in ``persistence`` of the
    steps (the straggler's own tests over those steps; its noise test is the shift's). What a
    watch names as soon as a fault has :data:`MIN_AFTER` steps, before its full look reads them
    (analyzer/live.py): from the digests alone, so a rank's wait for a core is in its own work
    here, as it is in :func:`onsets` on a run that did not record it."""
    rs = rs[rs.work_ns > 0]
    if rs.empty or rs.step.nunique() < 2 * MIN_AFTER:
        return []
    step = rs.groupby("step").step_ns.median().sort_index().astype(float)
    ratio = rs.work_ns / peer_reference(rs, ["step", "pp"], "work_ns")
    ratios = _wide(rs.assign(ratio=ratio), "ratio")
    out = []
    for rank, (x, shift) in shifts(excess_frame(rs, "work_ns"), step, th.min_excess).items():
        after = x.iloc[shift.at :]
        if after.median() < th.min_excess or (after >= th.min_excess / 2).mean() < th.persistence:
            continue
        since = ratios[rank].reindex(after.index) if rank in ratios else pd.Series(dtype=float)
        out.append(
            Turn(
                rank,
                int(after.index[0]),
                len(after),
                float(since.median()),
                float(after.median()),
                shift.z,
            )  # fmt: skip
        )
    return out


def _led(x: pd.Series, step: pd.Series, slowed: Shift, min_excess: float) -> Shift | None:
    """``x`` (a rank's excess, a share of the step, by step) split where the run's step time
    (``step``, ns by step) shifted up (``slowed``), where it shifted up there too and led it
    (:func:`onsets`); else None."""
    k = int(x.index.searchsorted(step.index[slowed.at]))
    if not MIN_AFTER <= k <= len(x) - MIN_AFTER:
        return None
    shift = split_at(x.to_numpy(), k)
    if shift.z < SHIFT_Z or shift.after - shift.before < min_excess:
        return None
    excess_ns = (x * step.reindex(x.index)).to_numpy()
    rise = float(np.median(excess_ns[k:]) - np.median(excess_ns[:k]))
    return shift if rise >= LEADS * (slowed.after - slowed.before) else None


def begun(
    ctx: Context,
    known: list[Finding],
    analyze_from: Callable[[int], list[Finding]],
    persistent: tuple[str, ...],
) -> list[Finding]:
    """The window's findings with the lasting faults that began inside it: ``analyze_from``
    gives the findings of the steps from a step to the window's end; ``persistent``: the kinds
    of a lasting fault (the registry's)."""
    late = onsets(ctx)
    if not late:
        return known
    seen = {(f["kind"], tuple(f["ranks"])) for f in known}
    new = [
        f
        for f in analyze_from(min(late.values()))
        if f["kind"] in persistent
        and set(f["ranks"]) <= set(late)
        and (f["kind"], tuple(f["ranks"])) not in seen
    ]

    return [f for f in known if not first_steps(f, new)] + new


def first_steps(f: Finding, lasting: list[Finding]) -> bool:
    """Whether ``f`` is a transient stall of the same ranks as one of ``lasting`` (faults named
    from their onset), at or after its onset: that fault's first steps (one fault, one
    finding)."""
    if f["kind"] != "transient_stall":
        return False
    stalls = (f.get("evidence") or {}).get("stall_steps") or []
    return any(
        g["ranks"] == f["ranks"] and bool(stalls) and min(stalls) >= g["steps"][0] for g in lasting
    )
