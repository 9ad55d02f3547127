"""The report's wording, shared by every renderer (text, markdown: analyzer.render.findings; HTML:
analyzer.render.findings_html): the headline, the ranks of a finding, what severity means, the line of
dismissed candidates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from analyzer.findings.record import Report, RunInfo


def ranks_text(ranks: list[int], limit: int = 12) -> str:
    """``ranks`` as a comma list, the first ``limit`` then how many more; "all" for none."""
    if not ranks:
        return "all"
    text = ", ".join(str(r) for r in ranks[:limit])
    return text + (f" … (+{len(ranks) - limit})" if len(ranks) > limit else "")


def headline(report: Report) -> str:
    """One line about the run: ranks, mesh axes over 1 (or that its layout is unknown), step
    range and median step."""
    return run_headline(report["run"])


def run_headline(run: RunInfo | Mapping[str, Any]) -> str:
    """:func:`headline` of a report's ``run`` (also a comparison's ``a`` and ``b``)."""
    mesh = " x ".join(f"{k}={v}" for k, v in run["mesh"].items() if v and v > 1) or "1 rank"
    layout = run.get("layout") or {}
    if layout.get("told") is False:  # an attached script's groups did not tell (meshinfer)
        mesh = "layout not told by its process groups"
    steps = run["steps"]
    span = f"steps {steps[0]}-{steps[1]}" if steps else "no steps"
    median = run.get("median_step_ms")
    step = f", median step {median:.1f} ms" if median is not None else ""
    return f"{run['world_size']} ranks ({mesh}), {span}{step}"


def severity_note(report: Report) -> str:
    """What the severity column means for this report."""
    how = (report.get("run") or {}).get("severity") or {}
    if how.get("method") == "whatif":
        late = any(
            (f.get("evidence") or {}).get("signal") == "late_arrival"
            for f in report.get("findings") or []
        )
        return (
            "severity: share of step time saved without the cause, replayed on the run's "
            "dependency graph (what-if)"
            + (
                "; a straggler named by its late arrival: the time its peers wait for it"
                if late
                else ""
            )
        )
    why = f" ({how['why']})" if how.get("why") else ""
    return f"severity: estimated share of step time saved without the fault{why}"


def dismissed_line(report: Report) -> str | None:
    """The candidates the what-if dismissed (saving under 1%), on one line."""
    gone = report.get("dismissed") or []
    if not gone:
        return None
    items = ", ".join(f"{f['kind']} {ranks_text(f['ranks'])} ({f['severity']:.1%})" for f in gone)
    return f"dismissed, fixing them would save under 1% of the step: {items}"
