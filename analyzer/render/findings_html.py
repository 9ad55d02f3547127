"""The findings report as one self-contained HTML file, with plotly figures embedded inline.

Figures are pure functions of DataFrames (``rank_steps`` of the analyzed window), so tests and
the dashboard can call them directly. plotly.js is inlined once, in the first figure, so the
file opens with no network.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from analyzer.render.words import dismissed_line, headline, ranks_text, severity_note

if TYPE_CHECKING:
    from analyzer.db import Run
    from analyzer.findings.record import Report


MAX_HEATMAP_RANKS = 512


def step_time_figure(rank_steps: pd.DataFrame) -> go.Figure:
    """Per step: the median and the slowest rank's step time, in ms."""
    per = rank_steps.groupby("step").step_ns.agg(["median", "max"]).sort_index() / 1e6
    fig = go.Figure()
    fig.add_scatter(x=per.index, y=per["median"], name="median rank", mode="lines+markers")
    fig.add_scatter(x=per.index, y=per["max"], name="slowest rank", mode="lines")
    fig.update_layout(title="Step time", xaxis_title="step", yaxis_title="ms", height=320)
    return fig


def compute_heatmap(rank_steps: pd.DataFrame) -> go.Figure:
    """Rank x step compute time relative to the step's median (MegaScale's heatmap)."""
    df = rank_steps[rank_steps["rank"] < MAX_HEATMAP_RANKS]
    med = df.groupby("step").compute_ns.transform("median")
    df = df.assign(rel=df.compute_ns / med.where(med > 0))
    grid = df.pivot_table(index="rank", columns="step", values="rel", aggfunc="mean")
    fig = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(),
            x=grid.columns,
            y=grid.index,
            colorscale="RdBu_r",
            zmid=1.0,
            colorbar={"title": "x median"},
        )
    )
    fig.update_layout(
        title="Compute time per rank and step, relative to the step's median",
        xaxis_title="step",
        yaxis_title="rank",
        height=max(300, min(900, 14 * len(grid) + 120)),
    )
    return fig


def rank_breakdown_figure(rank_steps: pd.DataFrame) -> go.Figure:
    """Per rank, median per step of compute, data, time in collectives and the rest."""
    per = rank_steps.groupby("rank")[["compute_ns", "data_ns", "comm_ns", "step_ns"]].median()
    per = per[per.index < MAX_HEATMAP_RANKS] / 1e6
    rest = (per.step_ns - per.compute_ns - per.data_ns - per.comm_ns).clip(lower=0)
    fig = go.Figure()
    for name, values in (
        ("compute", per.compute_ns),
        ("data", per.data_ns),
        ("in collectives", per.comm_ns),
        ("other", rest),
    ):
        fig.add_bar(x=per.index, y=values, name=name)
    fig.update_layout(
        barmode="stack",
        title="Where each rank's step goes (median per step)",
        xaxis_title="rank",
        yaxis_title="ms",
        height=360,
    )
    return fig


def _figures(run: Run | None, report: Report) -> list[go.Figure]:
    steps = report["run"]["steps"]
    if run is None or not steps:
        return []
    rs = run.query("findings/rank_steps", lo=steps[0], hi=steps[1])
    if rs.empty:
        return []
    return [step_time_figure(rs), compute_heatmap(rs), rank_breakdown_figure(rs)]


def _findings_html(report: Report) -> str:
    findings = report["findings"]
    if not findings:
        return "<p>No findings: no straggler, slow link, hang or crash was detected.</p>"
    rows = []
    for i, f in enumerate(findings, 1):
        evidence = html.escape(json.dumps(f["evidence"], indent=2))
        rows.append(
            f"<tr><td>{i}</td><td>{html.escape(f['kind'])}</td>"
            f"<td>{html.escape(ranks_text(f['ranks']))}</td><td>{f['severity']:.1%}</td>"
            f"<td>{html.escape(f['message'])}<details><summary>evidence</summary>"
            f"<pre>{evidence}</pre></details></td></tr>"
        )
    head = "<tr><th>#</th><th>kind</th><th>ranks</th><th>severity</th><th>what</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;width:100%}td,th{border:1px solid #ccc;padding:4px 8px;
vertical-align:top;text-align:left}th{background:#f3f3f3}pre{font-size:12px;margin:4px 0}
"""


def render_html(report: Report, run: Run | None = None) -> str:
    """One HTML page: headline, findings with their evidence, and the figures."""
    parts = []
    for i, fig in enumerate(_figures(run, report)):
        parts.append(pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>megascope findings</title>"
        f"<style>{STYLE}</style></head><body><h1>megascope findings</h1>"
        f"<p>{html.escape(headline(report))}</p>{_findings_html(report)}"
        f"<p><small>{html.escape(severity_note(report))}</small></p>"
        f"<p><small>{html.escape(dismissed_line(report) or '')}</small></p>"
        + "".join(f"<p>note: {html.escape(n['message'])}</p>" for n in report.get("notes") or [])
        + f"{''.join(parts)}</body></html>\n"
    )
