"""The findings report of docs/spec.md §3: ``analyze(run, steps=None) -> Report``.

Each detector is a module with ``detect(ctx) -> list[Finding]`` whose docstring gives its
algorithm and its severity estimate, and a ``DETECTOR`` declaring the kinds it emits
(:mod:`analyzer.findings.detector`); :mod:`analyzer.findings.registry` lists them. ``analyze``
picks the step window (the whole run without its warm-up steps, or the steps asked for), runs
every detector of the registry over a shared :class:`~analyzer.findings.common.Context`, prices
the findings with what fixing each changes in the replay, and sorts them by severity, highest
first. The records are :mod:`analyzer.findings.record`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pandas as pd

from analyzer import meshinfer
from analyzer.db import Run
from analyzer.duck import EXACT_MAX_RANKS
from analyzer.findings import dropped, hardware_imbalance, onset, regression, storage, throttle
from analyzer.findings.common import Context, Thresholds
from analyzer.findings.detector import Detector
from analyzer.findings.record import Finding, Note, Report, RunInfo
from analyzer.findings.registry import (
    DETECTORS,
    EXPLAINING,
    FINDING_KINDS,
    PERSISTENT,
    emitting,
    fix_of,
)
from analyzer.findings.severity import pricing
from analyzer.findings.spread_imbalance import spread

log = logging.getLogger(__name__)

SCHEMA = "megascope.findings/1"
__all__ = ["DETECTORS", "FINDING_KINDS", "PERSISTENT", "SCHEMA", "Finding", "Report", "analyze",
           "analyze_context", "live_last_step", "step_window"]  # fmt: skip


def step_window(run: Run, steps: tuple[int, int] | None, live: bool = False) -> tuple[int, int]:
    """The steps to analyze: ``steps`` when given, else the complete steps but the warm-up.

    Warm-up steps (allocator growth, first-call compilation, cold caches) are slower on every
    rank and say nothing about faults: one is left out from 4 recorded steps, two from 10. The
    window ends at the last step every rank finished: when a rank crashed or hung, or
    collectives were left without an end, the step it happened in is partial and left out
    (the hang and crash detectors read the whole run regardless). With ``live`` (a look at a
    run that may still be training), it ends at :func:`live_last_step` at the latest.
    """
    if steps is not None:
        return steps
    row = run.query("findings/step_range").iloc[0]
    if not row.n_steps or pd.isna(row.first_step):
        return (0, -1)
    first, last, n = int(row.first_step), int(row.last_step), int(row.n_steps)
    broken = row.unfinished > 0 or run.meta.get("status") in ("hung", "failed")
    if broken:
        last -= 1
    warmup = 2 if n >= 10 else 1 if n >= 4 else 0
    hi = max(last, first)
    if live:
        common, finished = row.common_last_step, row.finished_step
        hi = min(hi, live_last_step(
            run.meta, hi, None if pd.isna(common) else int(common),
            None if pd.isna(finished) else int(finished),
        ))  # fmt: skip
    return first + warmup, hi


def live_last_step(
    meta: dict[str, Any], last: int, common_last: int | None, finished: int | None
) -> int:
    """The newest step of a run that is still training whose rows every rank has written;
    ``last`` where the run has ended. ``last``: the newest step any rank wrote;
    ``common_last``: the newest every rank wrote; ``finished``: the newest every rank closed
    (wrote its ``step`` span; None where a rank writes none).

    A flush comes as a step begins and takes what the step has recorded so far, so the newest
    step a rank wrote may hold only its first spans, and the newest steps of one rank may not
    be written yet by another. Without ``step`` spans, the step before ``common_last``. On a
    GPU, a step's device-timed rows wait in the tracer until their CUDA events complete (the
    step after, or so): one step more."""
    if str(meta.get("status", "running")) != "running":
        return last
    if finished is None:
        finished = common_last - 1 if common_last is not None else last
    return min(last, finished - (1 if meta.get("device") == "cuda" else 0))


def _detect(
    ctx: Context,
    detectors: tuple[Detector, ...],
    whatif: bool,
    progress: Callable[[str], None] | None,
) -> tuple[list[Finding], list[Finding], dict[str, Any]]:
    """The findings of ``detectors`` over ``ctx``, priced by the what-if where asked: the
    findings, those dismissed, and how their severity was estimated."""
    findings: list[Finding] = []
    for d in detectors:
        if progress:
            progress(f"{d.name}…")
        findings += d.detect(ctx)
    # a stage all of a slower hardware class is that class's finding (before pricing: the
    # class's ranks hold the stage's, and would be priced beyond it)
    findings = hardware_imbalance.absorbed(findings)
    if not whatif:
        return findings, [], {"method": "estimate", "why": "what-if not asked for"}
    if progress:
        progress("what-if…")
    return pricing.price(ctx, findings, fix_of, spread)


def _explained_away(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """Drop transient stalls of ranks that also have a persistent finding, and a regression
    that the ranks other findings name explain (:func:`regression.explained`).

    A straggler's own time is longer in every step, and its noise scales with it, so some of
    its steps also look like spikes; the persistent finding already explains its lateness.
    """
    persistent = {r for f in findings if f["kind"] in PERSISTENT for r in f["ranks"]}
    drop_regression = any(f["kind"] == "regression" for f in findings) and regression.explained(
        ctx, findings, EXPLAINING
    )
    return [
        f
        for f in findings
        if not (f["kind"] == "transient_stall" and set(f["ranks"]) <= persistent)
        and not (f["kind"] == "regression" and drop_regression)
    ]


def analyze(
    run: Run,
    steps: tuple[int, int] | None = None,
    thresholds: Thresholds | None = None,
    progress: Callable[[str], None] | None = None,
    exact_max_ranks: int = EXACT_MAX_RANKS,
    whatif: bool = True,
    late_onsets: bool = True,
) -> Report:
    """Run every detector over ``run`` and return the findings report (SPEC §3).

    Up to ``exact_max_ranks`` ranks, collectives are matched across all ranks; past that, in
    the groups the detectors suspect only (see ``Context.matching``). With ``whatif`` the
    severities of stragglers, slow links and stage imbalance are their what-if savings, and
    candidates that save less than the noise are dismissed (:mod:`analyzer.findings.severity.cost`).
    With ``late_onsets``, a rank that turned slow too late in the window for the detectors is
    named from the steps since (:mod:`analyzer.findings.onset`).
    """
    lo, hi = step_window(run, steps)
    th = thresholds or Thresholds()
    ctx = Context(run=run, lo=lo, hi=hi, thresholds=th, exact_max_ranks=exact_max_ranks)
    return analyze_context(ctx, progress=progress, whatif=whatif, late_onsets=late_onsets)


def analyze_context(
    ctx: Context,
    progress: Callable[[str], None] | None = None,
    whatif: bool = True,
    late_onsets: bool = True,
) -> Report:
    """:func:`analyze` over the step window ``ctx`` holds, for a caller that reads more of the
    same window from ``ctx`` (its frames are computed once, whoever asks first)."""
    run, lo, hi = ctx.run, ctx.lo, ctx.hi
    findings, dismissed, severity = _detect(ctx, DETECTORS, whatif, progress)
    if late_onsets and hi > lo:

        def analyze_from(step: int) -> list[Finding]:
            # the persistent kinds only: what onset.begun takes from the steps since an onset
            return _detect(ctx.since(step), emitting(PERSISTENT), whatif, None)[0]

        findings = onset.begun(ctx, findings, analyze_from, PERSISTENT)
    findings = _explained_away(ctx, findings)
    notes: list[Note] = [
        n
        for n in (
            throttle.note(ctx),
            regression.note(ctx, findings, EXPLAINING),
            dropped.note(run.meta),
            meshinfer.note(run.meta),
            storage.note(run),
        )
        if n is not None
    ]
    findings.sort(key=lambda f: (-f["severity"], f["kind"], f["ranks"]))
    median = ctx.median_step_ns
    summary = run.meta.get("summary") or {}
    info: RunInfo = {
        "world_size": run.world_size,
        "mesh": run.mesh,
        "steps": [lo, hi] if hi >= lo else [],
        "median_step_ms": round(median / 1e6, 3) if median == median else None,
        "mfu": summary.get("mfu"),
        "severity": severity,
    }
    if run.meta.get("layout"):
        # an attached script's layout read from its process groups (analyzer.meshinfer)
        info["layout"] = run.meta["layout"]
    return {
        "schema": SCHEMA,
        "run": info,
        "findings": findings,
        "dismissed": dismissed,
        "notes": notes,
    }
