"""A long run in windows of steps: ``analyze --last N`` and ``analyze --windows K``.

The steps a report would analyze (docs/spec.md §3: the complete steps but the warm-up, or
``--steps``) are cut into windows of K steps (a last window of fewer than
``MIN_WINDOW`` steps joins the one before it), each analyzed as ``analyze --steps A:B`` would.
On the embedded engine the windows run one after another over the one opened run; on Dask
each window is a task that opens the run and analyzes its steps (the windows run side by side
on the workers). The timeline follows each fault (its kind and ranks) through the windows:
it begins with the first window that reports it and ends with the last of its consecutive
windows, so a straggler that appears at step 400 of 1,000 is dated: to the step where its
first steps show as a transient stall at the end of the window before (:func:`_onsets`), else
to the first window that names it.
"""

from __future__ import annotations

from typing import Any

from analyzer.db import Run, open_run
from analyzer.engine import Engine
from analyzer.findings import PERSISTENT, analyze, step_window

SCHEMA = "megascope.windows/1"
MIN_WINDOW = 2


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


def _window_task(window: tuple[int, int], path: str, whatif: bool) -> list[dict[str, Any]]:
    """One window on a worker: the run opened there, its findings over ``window``."""
    run = open_run(path)
    try:
        return analyze(run, steps=window, whatif=whatif)["findings"]
    finally:
        run.close()


def timeline(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """When each fault (kind and ranks) began and ended over the windows, in order of start."""
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
    out = _onsets(out, windows)
    out.sort(key=lambda e: (e["first_step"], e["kind"], e["ranks"]))
    return out


def _onsets(entries: list[dict[str, Any]], windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Date a lasting fault that began inside a window: there its first steps read as a
    transient stall of the same ranks at the window's end (too few to move the window's
    median). The straggler or data stall then begins with those steps, and that transient
    stall, read as its onset, leaves the timeline."""
    ends = {w["steps"][1]: w for w in windows}
    absorbed: list[int] = []
    for e in entries:
        if e["kind"] not in PERSISTENT or e["first_step"] - 1 not in ends:
            continue
        before = ends[e["first_step"] - 1]
        for f in before["findings"]:
            steps = sorted((f.get("evidence") or {}).get("stall_steps") or [])
            if f["kind"] != "transient_stall" or f["ranks"] != e["ranks"] or not steps:
                continue
            if steps[-1] != before["steps"][1]:
                continue
            first = steps[-1]
            while first - 1 in steps:
                first -= 1
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
    windows = [{"steps": [a, b], "findings": f} for (a, b), f in zip(spans, found, strict=True)]
    return {
        "schema": SCHEMA,
        "run": {
            "world_size": run.world_size,
            "mesh": run.mesh,
            "steps": [lo, hi] if spans else [],
            "window": k,
        },  # fmt: skip
        "windows": windows,
        "timeline": timeline(windows),
    }


def render_windows(report: dict[str, Any]) -> str:
    """The windows report as text: one line per window, then the timeline."""
    lines = [
        f"megascope analyze: {len(report['windows'])} windows of {report['run']['window']} steps"
    ]
    for w in report["windows"]:
        a, b = w["steps"]
        kinds = ", ".join(
            f"{f['kind']} {','.join(map(str, f['ranks'][:8]))} ({f['severity']:.1%})"
            for f in w["findings"]
        )
        lines.append(f"  steps {a}-{b}: {kinds or 'no findings'}")
    lines.append("timeline:" if report["timeline"] else "timeline: no faults")
    for e in report["timeline"]:
        ranks = ",".join(map(str, e["ranks"][:8])) + ("…" if len(e["ranks"]) > 8 else "")
        lines.append(
            f"  {e['kind']} ranks {ranks}: steps {e['first_step']}-{e['last_step']} "
            f"({e['windows']} windows, up to {e['max_severity']:.1%})"
        )
    return "\n".join(lines) + "\n"
