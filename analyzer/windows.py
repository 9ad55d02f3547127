"""A long run in windows of steps: ``analyze --last N`` and ``analyze --windows K``.

The steps a report would analyze (docs/spec.md §3: the complete steps but the warm-up, or
``--steps``) are cut into windows of K steps (a last window of fewer than
``MIN_WINDOW`` steps joins the one before it), each analyzed as ``analyze --steps A:B`` would.
On the embedded engine the windows run one after another over the one opened run; on Dask
each window is a task that opens the run and analyzes its steps (the windows run side by side
on the workers). The timeline follows each fault (its kind and ranks) through the windows:
it begins with the first window that reports it and ends with the last of its consecutive
windows. A lasting fault (a straggler, a data stall) is then dated to the step: its ranks'
series of excess over their peers is searched for a level shift (:mod:`analyzer.changepoint`)
from the window before the first that names it to the end of that one (its onset), and from
its last window to the end of the next (its end, when it ends before the run does). The first
steps of a fault that begins late in a window read as a transient stall of the same ranks at
that window's end: that stall is its onset, and leaves the timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

from analyzer.changepoint import level_shift
from analyzer.db import Run, open_run
from analyzer.executor import Engine
from analyzer.findings import analyze, registry, step_window
from analyzer.findings.common import Context
from analyzer.findings.onset import SHIFT_Z, excess_of
from analyzer.findings.record import Finding, Window

SCHEMA = "megascope.windows/1"
MIN_WINDOW = 2
# a lasting fault's series: the measure its ranks exceed their peers in (each kind's own,
# analyzer.findings.detector.Kind.measure)
MEASURE = registry.MEASURE
PERSISTENT = registry.PERSISTENT
# (kind, ranks, first step, last step) -> the fault's series over those steps, indexed by step
Series = Callable[[str, list[int], int, int], pd.Series]


def last_steps(run: Run, n: int, steps: tuple[int, int] | None = None) -> tuple[int, int]:
    """The last ``n`` steps of the window a report would analyze."""
    lo, hi = step_window(run, steps)
    return max(lo, hi - n + 1), hi


def cut(lo: int, hi: int, k: int) -> list[tuple[int, int]]:
    """Steps ``lo..hi`` in windows of ``k`` (the last one longer rather than too short)."""
    out = [(a, min(a + k - 1, hi)) for a in range(lo, hi + 1, k)]
    if len(out) > 1 and out[-1][1] - out[-1][0] + 1 < MIN_WINDOW:
        out[-2:] = [(out[-2][0], out[-1][1])]
    return out


def _window_task(window: tuple[int, int], path: str, whatif: bool) -> list[Finding]:
    """One window on a worker: the run opened there, its findings over ``window``."""
    run = open_run(path)
    try:
        return analyze(run, steps=window, whatif=whatif)["findings"]
    finally:
        run.close()


def timeline(windows: list[Window], series: Series | None = None) -> list[dict[str, Any]]:
    """When each fault (kind and ranks) began and ended over the windows, in order of start;
    a lasting fault dated to the step by the level shifts of its ``series`` (when given)."""
    out: list[dict[str, Any]] = []
    open_: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    for w in windows:
        a, b = w["steps"]
        seen: set[tuple[str, tuple[int, ...]]] = set()
        for f in w["findings"]:
            key = (f["kind"], tuple(f["ranks"]))
            if key in seen:
                continue
            seen.add(key)
            entry = open_.get(key)
            if entry is None:
                entry = {"kind": f["kind"], "ranks": list(f["ranks"]), "hosts": f.get("hosts"),
                         "first_step": a, "last_step": b, "windows": 0, "max_severity": 0.0}  # fmt: skip
                open_[key] = entry
                out.append(entry)
            entry["last_step"] = b
            entry["windows"] += 1
            entry["max_severity"] = max(entry["max_severity"], float(f["severity"]))
        for key in [k for k in open_ if k not in seen]:
            del open_[key]  # it ended: a later return is a new entry
    if series is not None:
        for e in out:
            _date(e, windows, series)
    out = _onsets(out, windows)
    out.sort(key=lambda e: (e["first_step"], e["kind"], e["ranks"]))
    return out


def _date(entry: dict[str, Any], windows: list[Window], series: Series) -> None:
    """A lasting fault's first and last steps, where a level shift of its series dates them:
    upward from the window before its first one through that one, downward from its last
    window through the next one (module docstring). ``onset``/``end``: ``change_point``."""
    if entry["kind"] not in MEASURE:
        return
    spans = [tuple(w["steps"]) for w in windows]
    first = next(i for i, (a, _) in enumerate(spans) if a == entry["first_step"])
    last = next(i for i, (_, b) in enumerate(spans) if b == entry["last_step"])
    if first > 0:
        got = _shift(entry, series, spans[first - 1][0], spans[first][1], up=True)
        if got is not None:
            entry["named_from"] = entry["first_step"]
            entry["first_step"], entry["onset"] = got, "change_point"
    if last < len(spans) - 1:
        got = _shift(entry, series, spans[last][0], spans[last + 1][1], up=False)
        if got is not None:
            entry["last_step"], entry["end"] = got - 1, "change_point"


def _shift(entry: dict[str, Any], series: Series, a: int, b: int, up: bool) -> int | None:
    """The step at which the fault's series over steps a..b shifts (up or down), if it does."""
    x = series(entry["kind"], entry["ranks"], a, b).dropna()
    shift = level_shift(x.to_numpy())
    if shift is None or shift.z < SHIFT_Z or (shift.after > shift.before) != up:
        return None
    return int(x.index[shift.at])


def excess_series(run: Run) -> Series:
    """The series of a lasting fault in ``run``: per step, its ranks' mean excess of the
    fault's measure (:data:`MEASURE`) over their stage's other ranks' median, a share of the step
    (:func:`analyzer.findings.onset.excess_of`)."""

    def series(kind: str, ranks: list[int], a: int, b: int) -> pd.Series:
        frame = excess_of(Context(run=run, lo=a, hi=b), MEASURE[kind])
        mine = [r for r in ranks if r in frame.columns]
        return frame[mine].mean(axis=1) if mine else pd.Series(dtype=float)

    return series


def _onsets(entries: list[dict[str, Any]], windows: list[Window]) -> list[dict[str, Any]]:
    """A lasting fault that began inside a window: there its first steps read as a transient
    stall of the same ranks at the window's end (too few to move the window's median). That
    transient stall is its onset, and leaves the timeline; where no level shift dated the
    fault, its first step is that stall's."""
    ends = {w["steps"][1]: w for w in windows}
    absorbed: list[int] = []
    for e in entries:
        named_from = e.pop("named_from", e["first_step"])
        if e["kind"] not in PERSISTENT or named_from - 1 not in ends:
            continue
        before = ends[named_from - 1]
        for f in before["findings"]:
            steps = sorted((f.get("evidence") or {}).get("stall_steps") or [])
            if f["kind"] != "transient_stall" or f["ranks"] != e["ranks"] or not steps:
                continue
            if steps[-1] != before["steps"][1]:
                continue
            first = steps[-1]
            while first - 1 in steps:
                first -= 1
            if "onset" not in e:
                e["first_step"], e["onset"] = first, "stall_steps"
            absorbed += [
                id(t) for t in entries
                if t["kind"] == "transient_stall" and t["ranks"] == e["ranks"]
                and t["last_step"] == before["steps"][1] and t["windows"] == 1
            ]  # fmt: skip
    return [e for e in entries if id(e) not in absorbed]


def analyze_windows(
    run: Run,
    k: int,
    engine: Engine,
    *,
    steps: tuple[int, int] | None = None,
    whatif: bool = True,
) -> dict[str, Any]:
    """The windows report: ``{"windows": [...], "timeline": [...]}`` (docs/spec.md §3)."""
    lo, hi = step_window(run, steps)
    spans = cut(lo, hi, k) if hi >= lo else []
    if engine.name == "local":
        found = [analyze(run, steps=w, whatif=whatif)["findings"] for w in spans]
    else:
        found = engine.map(_window_task, spans, path=run.path, whatif=whatif)
    windows: list[Window] = [
        {"steps": [a, b], "findings": f} for (a, b), f in zip(spans, found, strict=True)
    ]
    return {
        "schema": SCHEMA,
        "run": {
            "world_size": run.world_size,
            "mesh": run.mesh,
            "steps": [lo, hi] if spans else [],
            "window": k,
        },  # fmt: skip
        "windows": windows,
        "timeline": timeline(windows, excess_series(run)),
    }
