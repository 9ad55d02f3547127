"""The findings report rendered for people: text (rich tables), markdown, JSON.

The HTML report, with its plots, lives in :mod:`analyzer.report_html`. Every renderer takes
the dict that :func:`analyzer.findings.analyze` returns and nothing else, so what a user reads
is exactly what ``--json`` prints.
"""

from __future__ import annotations

import io
import json
from typing import Any

from rich.console import Console
from rich.table import Table

FORMATS = ("text", "json", "markdown", "html")


def _ranks(ranks: list[int], limit: int = 12) -> str:
    if not ranks:
        return "all"
    text = ", ".join(str(r) for r in ranks[:limit])
    return text + (f" … (+{len(ranks) - limit})" if len(ranks) > limit else "")


def _headline(report: dict[str, Any]) -> str:
    run = report["run"]
    mesh = " x ".join(f"{k}={v}" for k, v in run["mesh"].items() if v and v > 1) or "1 rank"
    steps = run["steps"]
    span = f"steps {steps[0]}-{steps[1]}" if steps else "no steps"
    median = run.get("median_step_ms")
    step = f", median step {median:.1f} ms" if median is not None else ""
    return f"{run['world_size']} ranks ({mesh}), {span}{step}"


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2) + "\n"


def render_text(report: dict[str, Any], width: int = 120, color: bool = False) -> str:
    """A headline and a table of findings (kind, ranks, severity, message), via rich."""
    buf = io.StringIO()
    console = Console(
        file=buf, width=width, force_terminal=color, color_system=None if not color else "auto"
    )
    console.print(f"[bold]megascope analyze[/bold]: {_headline(report)}")
    findings = report["findings"]
    if not findings:
        console.print("no findings: no straggler, slow link, hang or crash was detected")
        _print_dismissed(console, report)
        return buf.getvalue()
    table = Table(show_lines=False, header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("kind")
    table.add_column("ranks")
    table.add_column("severity", justify="right")
    table.add_column("what", overflow="fold")
    for i, f in enumerate(findings, 1):
        table.add_row(str(i), f["kind"], _ranks(f["ranks"]), f"{f['severity']:.1%}", f["message"])
    console.print(table)
    console.print(severity_note(report))
    _print_dismissed(console, report)
    return buf.getvalue()


def severity_note(report: dict[str, Any]) -> str:
    """What the severity column means for this report."""
    how = (report.get("run") or {}).get("severity") or {}
    if how.get("method") == "whatif":
        return (
            "severity: share of step time saved without the cause, replayed on the run's "
            "dependency graph (what-if)"
        )
    why = f" ({how['why']})" if how.get("why") else ""
    return f"severity: estimated share of step time saved without the fault{why}"


def dismissed_line(report: dict[str, Any]) -> str | None:
    """The candidates the what-if dismissed (saving under 1%), on one line."""
    gone = report.get("dismissed") or []
    if not gone:
        return None
    items = ", ".join(f"{f['kind']} {_ranks(f['ranks'])} ({f['severity']:.1%})" for f in gone)
    return f"dismissed, fixing them would save under 1% of the step: {items}"


def _print_dismissed(console: Console, report: dict[str, Any]) -> None:
    line = dismissed_line(report)
    if line:
        console.print(line, markup=False)
    for n in report.get("notes") or []:
        console.print(f"note: {n['message']}", markup=False)


def render_markdown(report: dict[str, Any]) -> str:
    """GitHub-flavoured markdown: a headline, a findings table and each finding's evidence."""
    lines = ["# megascope findings", "", _headline(report), ""]
    findings = report["findings"]
    if not findings:
        lines += ["No findings: no straggler, slow link, hang or crash was detected.", ""]
        return "\n".join(lines)
    lines += ["| # | kind | ranks | severity | what |", "|---|---|---|---|---|"]
    for i, f in enumerate(findings, 1):
        msg = f["message"].replace("|", "\\|")
        lines.append(f"| {i} | {f['kind']} | {_ranks(f['ranks'])} | {f['severity']:.1%} | {msg} |")
    lines.append("")
    for i, f in enumerate(findings, 1):
        lines += [f"## {i}. {f['kind']} (ranks {_ranks(f['ranks'])})", "", f["message"], ""]
        lines += ["```json", json.dumps(f["evidence"], indent=2), "```", ""]
    lines += [severity_note(report), ""]
    gone = dismissed_line(report)
    if gone:
        lines += [gone, ""]
    lines += [f"Note: {n['message']}" for n in report.get("notes") or []]
    return "\n".join(lines)


def render(report: dict[str, Any], fmt: str, run: Any = None) -> str:
    """The report in one of :data:`FORMATS` (``html`` also draws plots from ``run``)."""
    if fmt == "json":
        return render_json(report)
    if fmt == "markdown":
        return render_markdown(report)
    if fmt == "html":
        from analyzer.report_html import render_html

        return render_html(report, run)
    return render_text(report)
