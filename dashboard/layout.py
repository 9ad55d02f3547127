"""The page: controls on top, the 3D topology in the centre with the findings beside it,
the detail views in tabs below. Pure layout; the data arrive through the callbacks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dash import dcc, html

from dashboard.views import HEATMAP_DEFAULT, HEATMAP_MEASURES, METRIC_DEFAULT, METRICS, TIME

POLL_MS = 2000
GRAPH_CONFIG: dcc.Graph.Config = {"displaylogo": False, "scrollZoom": True}

_CARD = {
    "background": "#fff",
    "border": "1px solid #e3e3e3",
    "borderRadius": "6px",
    "padding": "8px",
}
_LABEL = {"fontSize": "12px", "color": "#555", "marginBottom": "2px"}


def _control(label: str, child: Any, width: str) -> html.Div:
    return html.Div(
        [html.Div(label, style=_LABEL), child], style={"width": width, "marginRight": "16px"}
    )


def _controls(runs: Sequence[str]) -> html.Div:
    single = list(runs) == ["."]
    picker = dcc.Dropdown(
        id="run", options=[{"label": n, "value": n} for n in runs], value=runs[0], clearable=False
    )
    metric_options = [{"label": f"{m.label} ({m.unit})", "value": k} for k, m in METRICS.items()]
    return html.Div(
        [
            html.Div(_control("run", picker, "220px"), style={"display": "none"} if single else {}),
            _control(
                "colour by",
                dcc.Dropdown(
                    id="metric", options=metric_options, value=METRIC_DEFAULT, clearable=False
                ),
                "320px",
            ),
            html.Div(_work_control(), id="work-box", style={"display": "none"}),
            _control(
                "steps",
                dcc.RangeSlider(
                    id="steps",
                    min=0,
                    max=1,
                    step=1,
                    value=[0, 1],
                    tooltip={"placement": "bottom"},
                    allowCross=False,
                ),
                "300px",
            ),
            _control(
                "slice",
                dcc.RadioItems(
                    id="slice-axis",
                    inline=True,
                    value="none",
                    options=[{"label": " whole cube ", "value": "none"}]
                    + [{"label": f" {a}= ", "value": a} for a in ("dp", "pp", "tp")],
                ),
                "230px",
            ),
            _control(
                "at",
                dcc.Slider(
                    id="slice-index",
                    min=0,
                    max=1,
                    step=1,
                    value=0,
                    disabled=True,
                    tooltip={"placement": "bottom"},
                ),
                "160px",
            ),
            _control(
                "cp",
                dcc.Dropdown(
                    id="cp",
                    options=[{"label": "fold (mean)", "value": -1}],
                    value=-1,
                    clearable=False,
                ),
                "160px",
            ),
        ],
        style={"display": "flex", "alignItems": "flex-end", "flexWrap": "wrap", **_CARD},
    )


def _work_control() -> html.Div:
    """The 3D view's choice of time (the "colour by" metric) or work per rank; shown, with
    the work kinds the run has, once a run with a ``work`` table is read (callbacks)."""
    return _control(
        "3D view: time or work (ratio to the median rank)",
        dcc.RadioItems(
            id="work",
            inline=True,
            value=TIME,
            options=[{"label": " time ", "value": TIME}],
        ),
        "330px",
    )


def _heatmap_measure() -> html.Div:
    """The rank x step heatmap's own measure; by default each rank's own time over its stage
    peers' median, so that the slow rank's row stands out (dashboard.views.HEATMAP_MEASURES)."""
    options = [{"label": f"{m.label} ({m.unit})", "value": k} for k, m in HEATMAP_MEASURES.items()]
    return html.Div(
        [
            html.Span("colour by ", style=_LABEL),
            dcc.Dropdown(
                id="heatmap-measure",
                options=options,
                value=HEATMAP_DEFAULT,
                clearable=False,
                style={"width": "460px"},
            ),
        ],
        style={"display": "flex", "alignItems": "center", "gap": "8px", "margin": "6px 0"},
    )


def _tabs() -> dcc.Tabs:
    step_input = html.Div(
        [
            "step ",
            dcc.Input(
                id="timeline-step",
                type="number",
                debounce=True,
                placeholder="last of range",
                style={"width": "110px"},
            ),
            html.Span(
                "  shows the selected rank with its pipeline and tensor-parallel peers (click a rank anywhere)",
                style={"color": "#666", "fontSize": "12px"},
            ),
        ],
        style={"margin": "6px 0"},
    )
    return dcc.Tabs(
        id="tabs",
        value="heatmap",
        children=[
            dcc.Tab(
                label="rank × step",
                value="heatmap",
                children=[
                    _heatmap_measure(),
                    dcc.Graph(id="heatmap", config=GRAPH_CONFIG, style={"height": "520px"}),
                ],
            ),
            dcc.Tab(
                label="timeline",
                value="timeline",
                children=[
                    step_input,
                    dcc.Graph(id="timeline", config=GRAPH_CONFIG, style={"height": "460px"}),
                ],
            ),
            dcc.Tab(
                label="links",
                value="links",
                children=[dcc.Graph(id="links", config=GRAPH_CONFIG, style={"height": "460px"})],
            ),
            dcc.Tab(
                label="what-if",
                value="whatif",
                children=[
                    html.Div(
                        id="whatif-info",
                        style={"margin": "6px 0", "color": "#444", "fontSize": "13px"},
                    ),
                    dcc.Graph(id="whatif", config=GRAPH_CONFIG, style={"height": "520px"}),
                ],
            ),
            dcc.Tab(
                label="plan",
                value="plan",
                children=[html.Div(id="plan-view", style={"margin": "6px 0"})],
            ),
            dcc.Tab(
                label="GPU telemetry",
                value="gpu",
                children=[dcc.Graph(id="gpu", config=GRAPH_CONFIG, style={"height": "520px"})],
            ),
        ],
    )


def page(runs: Sequence[str]) -> html.Div:
    """The whole page for the given run names (``["."]`` when one run is served)."""
    return html.Div(
        [
            dcc.Store(id="version"),
            dcc.Store(id="selected", data=[]),
            dcc.Store(id="finding-ranks", data=[]),
            dcc.Interval(id="poll", interval=POLL_MS, disabled=False),
            html.Div(
                [
                    html.H2("megascope", style={"margin": "0 16px 0 0"}),
                    html.Span(id="run-info", style={"color": "#444"}),
                    html.A(
                        "fleet",
                        href="/fleet",
                        id="fleet-link",
                        style={"marginLeft": "auto"}
                        if list(runs) != ["."]
                        else {"display": "none"},
                    ),  # fmt: skip
                ],
                style={"display": "flex", "alignItems": "baseline", "margin": "4px 0 8px"},
            ),
            _controls(runs),
            html.Div(
                [
                    html.Div(
                        dcc.Graph(id="topology", config=GRAPH_CONFIG, style={"height": "600px"}),
                        style={"flex": "3", "minWidth": "480px", **_CARD},
                    ),
                    html.Div(
                        [html.H4("findings", style={"margin": "0 0 6px"}), html.Div(id="findings")],
                        style={
                            "flex": "2",
                            "minWidth": "320px",
                            "maxHeight": "616px",
                            "overflowY": "auto",
                            **_CARD,
                        },
                    ),
                ],
                style={"display": "flex", "gap": "10px", "margin": "10px 0"},
            ),
            html.Div(
                dcc.Graph(id="slab", config=GRAPH_CONFIG, style={"height": "380px"}),
                id="slab-box",
                style={"display": "none"},
            ),
            html.Div(id="rank-info", style={"margin": "6px 0", **_CARD}),
            _tabs(),
        ],
        style={"fontFamily": "system-ui, sans-serif", "background": "#fafafa", "padding": "10px"},
    )


SEVERITY_COLORS = ((0.2, "#d62728"), (0.05, "#ff7f0e"), (0.0, "#7f7f7f"))


def findings_panel(report: Mapping[str, Any]) -> list[Any]:
    """One card per finding: kind, severity (share of step time), message, a button that
    selects its ranks in every view (pattern-matched id ``{"type": "finding", "index": i}``)."""
    items: list[Any] = []
    if report.get("note"):
        items.append(html.Div(report["note"], style={"color": "#666", "fontStyle": "italic"}))
    findings = report.get("findings", [])
    if not findings:
        items.append(
            html.Div("no findings in this step range", id="no-findings", style={"color": "#2ca02c"})
        )
    for i, f in enumerate(findings):
        severity = float(f.get("severity", 0.0))
        color = next(c for limit, c in SEVERITY_COLORS if severity >= limit)
        ranks = ", ".join(str(r) for r in f.get("ranks", [])[:16])
        items.append(
            html.Div(
                [
                    html.Div(
                        [
                            html.B(f.get("kind", "?"), style={"color": color}),
                            html.Span(
                                f"  severity {severity:.0%}",
                                style={"color": color, "fontSize": "12px"},
                            ),
                        ]
                    ),
                    html.Div(
                        f.get("message", ""),
                        className="finding-message",
                        style={"fontSize": "13px", "margin": "2px 0"},
                    ),
                    html.Button(
                        f"show ranks {ranks}",
                        id={"type": "finding", "index": i},
                        n_clicks=0,
                        style={"fontSize": "12px"},
                    ),
                ],
                className="finding",
                style={"borderLeft": f"4px solid {color}", "padding": "4px 8px", "margin": "6px 0"},
            )
        )
    return items
