"""The findings report rendered for people: text (rich tables), markdown, JSON.

The HTML report, with its plots, lives in :mod:`analyzer.render.findings_html`. Every renderer takes
the :class:`~analyzer.findings.record.Report` that :func:`analyzer.findings.analyze` returns and nothing else, so what a user reads
is exactly what ``--json`` prints.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from analyzer.render.words import dismissed_line, headline, ranks_text, severity_note

if TYPE_CHECKING:
    from analyzer.db import Run
    from analyzer.findings.record import Report


FORMATS = ("text", "json", "markdown", "html")


def render_json(report: Mapping[str, Any]) -> str:
    """A report (the findings', the windows', a comparison's) as indented JSON, with a final
    newline."""
    return json.dumps(report, indent=2) + "\n"


def render_text(report: Report, width: int = 120, color: bool = False) -> str:
    """A headline and a table of findings (kind, ranks, severity, message), via rich."""
    buf = io.StringIO()
    console = Console(
        file=buf, width=width, force_terminal=color, color_system=None if not color else "auto"
    )
    console.print(f"[bold]megascope analyze[/bold]: {headline(report)}")
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
        table.add_row(
            str(i), f["kind"], ranks_text(f["ranks"]), f"{f['severity']:.1%}", f["message"]
        )
    console.print(table)
    console.print(severity_note(report))
    _print_dismissed(console, report)
    return buf.getvalue()


def _print_dismissed(console: Console, report: Report) -> None:
    line = dismissed_line(report)
    if line:
        console.print(line, markup=False)
    for n in report.get("notes") or []:
        console.print(f"note: {n['message']}", markup=False)


def render_markdown(report: Report) -> str:
    """GitHub-flavoured markdown: a headline, a findings table and each finding's evidence."""
    lines = ["# megascope findings", "", headline(report), ""]
    findings = report["findings"]
    if not findings:
        lines += ["No findings: no straggler, slow link, hang or crash was detected.", ""]
        return "\n".join(lines)
    lines += ["| # | kind | ranks | severity | what |", "|---|---|---|---|---|"]
    for i, f in enumerate(findings, 1):
        msg = f["message"].replace("|", "\\|")
        lines.append(
            f"| {i} | {f['kind']} | {ranks_text(f['ranks'])} | {f['severity']:.1%} | {msg} |"
        )
    lines.append("")
    for i, f in enumerate(findings, 1):
        lines += [f"## {i}. {f['kind']} (ranks {ranks_text(f['ranks'])})", "", f["message"], ""]
        lines += ["```json", json.dumps(f["evidence"], indent=2), "```", ""]
    lines += [severity_note(report), ""]
    gone = dismissed_line(report)
    if gone:
        lines += [gone, ""]
    lines += [f"Note: {n['message']}" for n in report.get("notes") or []]
    return "\n".join(lines)


def render(report: Report, fmt: str, run: Run | None = None) -> str:
    """The report in one of :data:`FORMATS` (``html`` also draws plots from ``run``)."""
    if fmt == "json":
        return render_json(report)
    if fmt == "markdown":
        return render_markdown(report)
    if fmt == "html":
        from analyzer.render.findings_html import render_html

        return render_html(report, run)
    return render_text(report)
