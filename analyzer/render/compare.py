"""The report of ``megascope compare`` rendered for people: text, markdown, HTML, JSON.

Every renderer takes the dict that :func:`analyzer.compare.compare` returns and nothing else, so
what a user reads is what ``--json`` prints. The sentences (:func:`summary_lines`) are shared:
the verdict on the step time, the phases and collective kinds that changed, the ranks whose own
work changed and those that only waited, the findings that appeared and disappeared.
"""

from __future__ import annotations

import html
import io
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from rich.console import Console
from rich.table import Table

from analyzer.render.findings import render_json
from analyzer.render.words import ranks_text, run_headline

PHASE_WORDS = {
    "step": "step",
    "own": "own work",
    "data": "data",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "exposed_comm": "exposed communication",
}
COLUMNS = ("", "A ms", "B ms", "B - A ms", "95% interval ms", "change", "verdict")
MAX_RANK_ROWS = 16  # ranks in the table
MAX_RANK_LINES = 4  # ranks named one line each


def _signed(x: float | None, unit: str = " ms") -> str:
    return "n/a" if x is None else f"{x:+.1f}{unit}"


def _interval(r: dict[str, Any]) -> str:
    if r["low_ms"] is None:
        return "n/a"
    return f"{r['low_ms']:+.1f} to {r['high_ms']:+.1f}"


def _cells(name: str, r: dict[str, Any]) -> list[str]:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    pct = "-" if r["change_pct"] is None else f"{r['change_pct']:+.1f}%"
    return [name, ms(r["a_ms"]), ms(r["b_ms"]), _signed(r["diff_ms"], ""), _interval(r), pct,
            r["verdict"]]  # fmt: skip


def _coords_text(c: dict[str, Any]) -> str:
    axes = " ".join(
        f"{k}{c[k]}" for k in ("dp", "pp", "tp", "cp") if k in c and (c[k] or k != "cp")
    )
    return ", ".join(x for x in (axes, c.get("host", "")) if x)


def _changes(rows: list[tuple[str, dict[str, Any]]]) -> str:
    moved = [(n, r) for n, r in rows if r["verdict"] in ("slower", "faster")]
    moved.sort(key=lambda nr: -abs(nr[1]["diff_ms"] or 0))
    return ", ".join(f"{n} {_signed(r['diff_ms'])}" for n, r in moved)


def _findings_line(word: str, items: list[dict[str, Any]]) -> str:
    if not items:
        return f"findings {word}: none"
    text = "; ".join(
        f"{f['kind']} (ranks {ranks_text(f['ranks'])}, {f['severity']:.1%})" for f in items
    )
    return f"findings {word}: {text}"


def _anything_changed(report: dict[str, Any]) -> bool:
    rows = [*report["phases"], *report["collectives"]]
    return any(r["verdict"] != "within noise" for r in rows) or bool(report["changed_ranks"])


def _rank_line(r: dict[str, Any]) -> str:
    own = r.get("own") or {}
    parts = _changes([(PHASE_WORDS[m], r[m]) for m in PHASE_WORDS
                      if m in r and m not in ("step", "own")])  # fmt: skip
    where = f" ({_coords_text(r['coords'])})" if r["coords"] else ""
    return (
        f"rank {r['rank']}{where} changed: own work {_signed(own.get('diff_ms'))} "
        f"({_signed(own.get('change_pct'), '%')}); {parts or 'within noise by phase'}"
    )


def _rank_lines(moved: list[dict[str, Any]], world: int) -> list[str]:
    """A line per rank whose own work changed; past ``MAX_RANK_LINES`` of them, one line for
    all (a change of every rank: a larger batch, a new library) and the largest few."""
    if len(moved) <= MAX_RANK_LINES:
        return [_rank_line(r) for r in moved]
    diffs = [r["own"]["diff_ms"] for r in moved if (r.get("own") or {}).get("diff_ms") is not None]
    span = f": own work {_signed(min(diffs))} to {_signed(max(diffs))}" if diffs else ""
    moved = sorted(moved, key=lambda r: -abs((r.get("own") or {}).get("diff_ms") or 0))
    named = ranks_text(sorted(r["rank"] for r in moved))
    head = f"{len(moved)} of {world} ranks changed (ranks {named}){span}"
    return [head, *(_rank_line(r) for r in moved[: MAX_RANK_LINES - 1])]


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The comparison in sentences, most important first."""
    s = report["step"]
    step = (
        f"step {s['a_ms'] or 0:.1f} -> {s['b_ms'] or 0:.1f} ms, {_signed(s['diff_ms'])} "
        f"({_signed(s['change_pct'], '%')}), 95% interval {_interval(s)} ms"
    )
    if s["verdict"] in ("slower", "faster"):
        lines = [f"B is {s['verdict']} than A: {step}"]
    elif _anything_changed(report):
        lines = [f"no difference in step time beyond noise, but parts changed: {step}"]
    else:
        lines = [f"{report['verdict']}: {step}"]
    where = _changes([(PHASE_WORDS[p["phase"]], p) for p in report["phases"]])
    if where:
        lines.append(f"phases beyond noise: {where}")
    kinds = _changes([(f"{k['group']} {k['op']}", k) for k in report["collectives"]])
    if kinds:
        lines.append(f"collectives beyond noise: {kinds}")
    gone = [f"{k['group']} {k['op']} ({k['verdict']})" for k in report["collectives"]
            if k["verdict"].startswith("only")]  # fmt: skip
    if gone:
        lines.append("collective kinds of one run only: " + ", ".join(gone))
    lines += _rank_lines([r for r in report["ranks"] if r["changed"]], len(report["ranks"]))
    if report["waiting_ranks"]:
        lines.append(
            f"ranks {ranks_text(report['waiting_ranks'])} only waited: their exposed "
            "communication changed, their own work did not"
        )
    lines += [f"note: {n}" for n in report.get("notes") or []]
    f = report["findings"]
    lines += [_findings_line("that appeared in B", f["appeared"]),
              _findings_line("that disappeared from A", f["disappeared"])]  # fmt: skip
    fa = report.get("fail_above")
    if fa:
        lines.append(fa["reason"])  # the gate's decision in one line (analyzer/compare_gate.py)
    return lines


def _verdict_line(report: dict[str, Any]) -> str:
    return summary_lines(report)[0]


def headlines(report: dict[str, Any]) -> list[str]:
    """One line for each run, A then B: its path, ranks, mesh, steps and median step."""
    return [f"{k.upper()}: {report[k]['path']}: {run_headline(report[k])}" for k in "ab"]


def _tables(report: dict[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """The report's tables: run-wide (step and phases), collective kinds, ranks that moved."""
    run = [_cells("step", report["step"])]
    run += [_cells(PHASE_WORDS[p["phase"]], p) for p in report["phases"]]
    kinds = [_cells(f"{k['group']} {k['op']}", k) for k in report["collectives"]]
    shown = [r for r in report["ranks"] if r["changed"] or r["waited"]][:MAX_RANK_ROWS]
    ranks = []
    for r in shown:
        for m in ("own", "exposed_comm"):
            if m in r:
                ranks.append(_cells(f"rank {r['rank']} {PHASE_WORDS[m]}", r[m]))
    out = [("step and phases (per step: median rank's step, mean rank's phase)", run),
           ("time blocked in collectives (per step, mean rank)", kinds)]  # fmt: skip
    if ranks:
        out.append(("ranks that changed or waited", ranks))
    return out


def render_text(report: dict[str, Any], width: int = 120) -> str:
    """The comparison for a terminal: verdict, headlines, tables (via rich) and the summary's other
    lines."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None)
    console.print("[bold]megascope compare[/bold]: " + _verdict_line(report))
    for line in headlines(report):
        console.print(line, markup=False)
    for title, rows in _tables(report):
        table = Table(title=title, header_style="bold", title_justify="left")
        for col in COLUMNS:
            table.add_column(col, justify="left" if col in ("", "verdict") else "right")
        for cells in rows:
            table.add_row(*cells)
        console.print(table)
    for line in summary_lines(report)[1:]:
        console.print(line, markup=False)
    return buf.getvalue()


def render_markdown(report: dict[str, Any]) -> str:
    """The comparison as GitHub-flavoured markdown: verdict, headlines, tables, summary."""
    lines = ["# megascope compare", "", _verdict_line(report), ""]
    lines += [f"- {h}" for h in headlines(report)] + [""]
    for title, rows in _tables(report):
        lines += [f"## {title}", "", "| " + " | ".join(c or "what" for c in COLUMNS) + " |",
                  "|" + "---|" * len(COLUMNS)]  # fmt: skip
        lines += ["| " + " | ".join(cells) + " |" for cells in rows]
        lines.append("")
    lines += [f"- {line}" for line in summary_lines(report)[1:]]
    return "\n".join(lines) + "\n"


STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin-bottom:1em}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:right}td:first-child,td:last-child,th:first-child,th:last-child{text-align:left}th{background:#f3f3f3}
"""


def step_figure(report: dict[str, Any]) -> go.Figure:
    """Per step: A's and B's step time (the median rank's), in ms."""
    fig = go.Figure()
    for side in "ab":
        rows = report["per_step"][side]
        fig.add_scatter(x=[r["step"] for r in rows], y=[r["step_ms"] for r in rows],
                        name=f"{side.upper()}: {report[side]['path']}", mode="lines+markers")  # fmt: skip
    fig.update_layout(title="Step time", xaxis_title="step", yaxis_title="ms", height=320)
    return fig


def phase_figure(report: dict[str, Any]) -> go.Figure:
    """A's and B's step split into phases (medians over steps), stacked, in ms."""
    fig = go.Figure()
    for p in report["phases"]:
        fig.add_bar(x=["A", "B"], y=[p["a_ms"], p["b_ms"]], name=PHASE_WORDS[p["phase"]])
    fig.update_layout(barmode="stack", title="Where a step goes (mean rank, median step)",
                      yaxis_title="ms", height=360)  # fmt: skip
    return fig


def render_html(report: dict[str, Any]) -> str:
    """The comparison as one self-contained HTML page, with the step and phase plots (plotly.js
    embedded once)."""
    body = [f"<h1>megascope compare</h1><p><b>{html.escape(_verdict_line(report))}</b></p>"]
    body += ["<ul>" + "".join(f"<li>{html.escape(h)}</li>" for h in headlines(report)) + "</ul>"]
    for title, rows in _tables(report):
        head = "".join(f"<th>{html.escape(c or 'what')}</th>" for c in COLUMNS)
        cells = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
        )
        body.append(f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{cells}</table>")
    body.append(
        "<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in summary_lines(report)[1:]) + "</ul>"
    )
    for i, fig in enumerate((step_figure(report), phase_figure(report))):
        body.append(pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>megascope compare</title>"
        f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n"
    )


def render(report: dict[str, Any], fmt: str) -> str:
    """The report as ``text``, ``json``, ``markdown`` or ``html``."""
    if fmt == "json":
        return render_json(report)
    if fmt == "markdown":
        return render_markdown(report)
    if fmt == "html":
        return render_html(report)
    return render_text(report)
