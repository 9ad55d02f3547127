"""The fleet report (``megascope fleet``) as text: a table of runs, then the hosts, GPUs and
links that were culprits in several."""

from __future__ import annotations

import io
from typing import Any


def render_text(report: dict[str, Any], width: int = 140) -> str:
    """The fleet report for a terminal: a table of runs (via rich), then the repeat culprits by
    host, GPU and link."""
    from rich.console import Console
    from rich.table import Table

    from analyzer.fleet import row_cells

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None)
    table = Table(header_style="bold")
    for col in ("job", "shape", "steps", "MFU", "status", "findings"):
        table.add_column(col, overflow="fold")
    for r in report["runs"]:
        table.add_row(*row_cells(r, ranks=4, hosts=3))
    console.print(f"[bold]megascope fleet[/bold]: {len(report['runs'])} runs")
    console.print(table)
    for key, what in (
        ("repeat_culprits", "host"),
        ("repeat_gpus", "gpu"),
        ("repeat_links", "link"),
    ):
        items = report[key]
        console.print(f"repeat culprits ({what}s):" + (" none" if not items else ""), markup=False)
        for e in items:
            classes = sorted({c for c in e.get("hw_classes") or [] if c})
            console.print(
                f"  {e[what]}"
                + (f" [{', '.join(classes)}]" if classes else "")
                + f": {len(e['runs'])} runs ({', '.join(e['runs'])}), "
                f"{', '.join(e['kinds'])}, severity up to {max(e['severities']):.1%}",
                markup=False,
            )
    return buf.getvalue()
