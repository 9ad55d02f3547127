"""The fleet page (``/fleet``) of a dashboard serving a folder of runs: the runs table and
each host's history, from :func:`analyzer.fleet.fleet` over the served runs.

It is a plain HTML page served by the app's Flask server (no callbacks), made on its first
request and again when the runs on offer change. The runs are those of the run picker
(:class:`dashboard.runs.RunRegistry`), never a path from the browser.
"""

from __future__ import annotations

import html
import threading
from typing import Any

import dash

from dashboard.runs import RunRegistry

_STYLE = (
    "body{font-family:sans-serif;margin:16px;color:#222}table{border-collapse:collapse;"
    "margin-bottom:20px}td,th{border:1px solid #ddd;padding:4px 8px;font-size:13px;"
    "text-align:left}th{background:#f4f4f4}.hot{background:#fde8e8}"
)


def _runs_table(report: dict[str, Any]) -> str:
    from analyzer.fleet import row_cells

    rows = []
    for r in report["runs"]:
        cells = row_cells(r, ranks=6, hosts=4)
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{c}</th>" for c in ("job", "shape", "steps", "MFU", "status", "findings"))
    return f"<table id='fleet-runs'><tr>{head}</tr>{''.join(rows)}</table>"


def _hosts_table(report: dict[str, Any]) -> str:
    from analyzer.fleet import host_history

    repeat = {e["host"] for e in report["repeat_culprits"]}
    rows = []
    for host, history in host_history(report).items():
        events = history["findings"]
        text = "; ".join(f"{e['job']}: {e['kind']} ({e['severity']:.0%})" for e in events)
        runs = ", ".join(history["runs"])
        cls = " class='hot'" if host in repeat else ""
        rows.append(
            f"<tr{cls}><td>{html.escape(host)}</td><td>{html.escape(runs)}</td>"
            f"<td>{html.escape(text or '-')}</td></tr>"
        )
    return (
        "<table id='fleet-hosts'><tr><th>host</th><th>runs on it</th><th>findings naming it</th>"
        "</tr>" + "".join(rows) + "</table>"
    )


def _classes(entry: dict[str, Any]) -> str:
    """`` [h100]``: the hardware classes a repeat culprit had in its runs ('' for none)."""
    classes = sorted({c for c in entry.get("hw_classes") or [] if c})
    return f" [{', '.join(classes)}]" if classes else ""


def render(report: dict[str, Any]) -> str:
    """The fleet page as one HTML document: the runs, the repeat culprits, each host's history and
    the runs skipped."""
    repeat = ", ".join(
        f"{e['host']}{_classes(e)} ({len(e['runs'])} runs: {', '.join(e['kinds'])})"
        for e in report["repeat_culprits"]
    )
    skipped = "".join(f"<li>{html.escape(s['error'])}</li>" for s in report["skipped"])
    return (
        f"<!doctype html><html><head><title>megascope fleet</title><style>{_STYLE}</style>"
        f"</head><body><h2>fleet: {len(report['runs'])} runs</h2>"
        f"<p id='fleet-repeat'>culprit in more than one run: {html.escape(repeat or 'none')}</p>"
        f"{_runs_table(report)}<h3>each host's history</h3>{_hosts_table(report)}"
        + (f"<h3>skipped</h3><ul>{skipped}</ul>" if skipped else "")
        + "<p><a href='/'>back to the runs</a></p></body></html>"
    )


def register_fleet(app: dash.Dash, registry: RunRegistry) -> None:
    """Serve ``/fleet`` on the app's Flask server."""
    lock = threading.Lock()
    cache: dict[str, Any] = {}

    @app.server.route("/fleet")
    def fleet_page() -> tuple[str, int]:
        from analyzer.executor import LocalEngine
        from analyzer.fleet import fleet

        names = [n for n in registry.names() if n != "."] or ["."]
        with lock:
            if cache.get("names") != names:
                paths = [str(registry.resolve(n)) for n in names]
                cache["page"] = render(fleet(paths, LocalEngine(), whatif=False))
                cache["names"] = names
            return cache["page"], 200
