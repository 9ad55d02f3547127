"""The windows report of a long run (``megascope analyze --windows K``) as text: one line per
window, then the timeline of faults."""

from __future__ import annotations

from typing import Any


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
