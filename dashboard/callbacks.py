"""The page's callbacks: short functions that ask dashboard.views for data and
dashboard.figures for a figure.

Flow: ``poll`` (a dcc.Interval, every 2 s while the run's status is "running") stores the
run's data version; every figure takes that version as an input, so a new part written by a
rank re-draws the page without a reload, and nothing is re-queried while it stays the same.
A click on a rank in any view (or a finding's button) sets the ``selected`` store, which the
other views outline, and opens the timeline of that rank's pipeline group. Heavy views are
drawn only while their tab is open; the what-if replays once per data version and step range
(cached by the run's source).
"""

from __future__ import annotations

import logging
from typing import Any

import dash
import duckdb
from dash import ALL, Input, Output, State, ctx, html, no_update

from analyzer.db import RunError
from dashboard import figures as fig
from dashboard import figures_detail as detail
from dashboard import figures_whatif as whatif_fig
from dashboard import plan_view, views
from dashboard.layout import findings_panel
from dashboard.runs import RunPathError, RunRegistry

log = logging.getLogger(__name__)
EXPECTED = (RunPathError, RunError, ValueError, KeyError, duckdb.Error, OSError)


def _steps(value: Any) -> tuple[int, int]:
    """A step range from the slider (two ints), refused otherwise."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"bad step range {value!r}")
    lo, hi = (int(v) for v in value)
    return min(lo, hi), max(lo, hi)


def _rank_of_click(click: Any) -> int | None:
    """The rank a plotly click names: ``customdata`` (or its first element) of the point."""
    try:
        data = click["points"][0]["customdata"]
    except (TypeError, KeyError, IndexError):
        return None
    if isinstance(data, list):
        data = data[0] if data else None
    try:
        rank = int(data)
    except (TypeError, ValueError):
        return None
    return rank if rank >= 0 else None


def _marked(report: dict[str, Any]) -> list[int]:
    return sorted({int(r) for f in report.get("findings", []) for r in f.get("ranks", [])})


def _run_info(src: Any) -> str:
    m = src.meta
    mesh = " ".join(f"{k}{v}" for k, v in src.mesh.items())
    live = " · LIVE (following new data)" if src.live else ""
    gap = f" · missing the folders of {src.missing}" if src.missing else ""
    return f"{m.get('run_id', '?')} · {m.get('status', '?')} · {m.get('world_size', '?')} ranks · {mesh}{live}{gap}"


def register(app: dash.Dash, registry: RunRegistry) -> None:
    """Attach every callback of the page to ``app``."""
    _register_run(app, registry)
    _register_controls(app, registry)
    _register_findings(app, registry)
    _register_topology(app, registry)
    _register_rank_info(app, registry)
    _register_heatmap(app, registry)
    _register_timeline(app, registry)
    _register_links_gpu(app, registry)
    _register_whatif(app, registry)
    _register_plan(app, registry)


def _register_run(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("version", "data"),
        Output("poll", "disabled"),
        Output("run-info", "children"),
        Input("poll", "n_intervals"),
        Input("run", "value"),
        State("version", "data"),
    )
    def poll(_n: int, name: str, old: Any) -> tuple:
        try:
            src = registry.get(name)
            new = {"run": name, "v": list(src.refresh())}
        except EXPECTED as e:
            return no_update, True, f"cannot read run: {str(e).splitlines()[0]}"
        if new == old:
            return no_update, not src.live, no_update
        return new, not src.live, _run_info(src)

    @app.callback(
        Output("steps", "min"),
        Output("steps", "max"),
        Output("steps", "value"),
        Output("steps", "marks"),
        Input("version", "data"),
        State("steps", "value"),
        State("steps", "max"),
    )
    def steps(version: Any, value: Any, old_max: Any) -> tuple:
        if not version:
            return no_update, no_update, no_update, no_update
        first, last = views.step_bounds(registry.get(version["run"]))
        lo, hi = value if isinstance(value, list) and len(value) == 2 else (first, last)
        follow = old_max is None or hi >= old_max  # the range ended at the newest step
        lo = lo if first <= lo <= last else first
        hi = last if follow else min(max(hi, lo), last)
        return first, last, [lo, hi], {first: str(first), last: str(last)}


def _register_controls(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("slice-index", "max"),
        Output("slice-index", "disabled"),
        Output("slice-index", "value"),
        Input("slice-axis", "value"),
        Input("version", "data"),
        State("slice-index", "value"),
    )
    def slice_index(axis: str, version: Any, value: Any) -> tuple:
        if not version or axis not in fig.AXES:
            return 1, True, 0
        size = registry.get(version["run"]).mesh[axis]
        return max(size - 1, 0), False, min(int(value or 0), size - 1)

    @app.callback(Output("cp", "options"), Input("version", "data"))
    def cp_options(version: Any) -> list | dash.NoUpdate:
        if not version:
            return no_update
        cp = registry.get(version["run"]).mesh["cp"]
        return [{"label": "fold (mean)", "value": -1}] + [
            {"label": f"cp={i}", "value": i} for i in range(cp if cp > 1 else 0)
        ]

    @app.callback(
        Output("work", "options"),
        Output("work", "value"),
        Output("work-box", "style"),
        Input("version", "data"),
        State("work", "value"),
    )
    def work_options(version: Any, value: Any) -> tuple:
        if not version:
            return no_update, no_update, no_update
        try:
            kinds = views.work_kinds(registry.get(version["run"]))
        except EXPECTED:
            kinds = []
        options = [{"label": " time ", "value": views.TIME}] + [
            {"label": f" {views.WORK_LABELS[k]} ", "value": k} for k in kinds
        ]
        keep = value if value in kinds else views.TIME
        return options, keep, {"display": "block"} if kinds else {"display": "none"}


def _register_findings(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("findings", "children"),
        Output("finding-ranks", "data"),
        Input("version", "data"),
        Input("steps", "value"),
    )
    def findings(version: Any, steps_value: Any) -> tuple:
        if not version:
            return no_update, no_update
        try:
            report = views.findings(registry.get(version["run"]), *_steps(steps_value))
        except EXPECTED as e:
            return [f"cannot analyze: {str(e).splitlines()[0]}"], []
        ranks = [[int(r) for r in f.get("ranks", [])] for f in report.get("findings", [])]
        return findings_panel(report), ranks

    @app.callback(
        Output("selected", "data"),
        Output("tabs", "value"),
        Input("topology", "clickData"),
        Input("slab", "clickData"),
        Input("heatmap", "clickData"),
        Input("gpu", "clickData"),
        Input("whatif", "clickData"),
        Input({"type": "finding", "index": ALL}, "n_clicks"),
        State("finding-ranks", "data"),
        prevent_initial_call=True,
    )
    def select(*args: Any) -> tuple:
        trigger = ctx.triggered_id
        finding_ranks = args[-1] or []
        if isinstance(trigger, dict) and trigger.get("type") == "finding":
            index = int(trigger.get("index", -1))
            if not ctx.triggered[0].get("value") or not 0 <= index < len(finding_ranks):
                return no_update, no_update
            return finding_ranks[index], "timeline"
        rank = _rank_of_click(ctx.triggered[0].get("value") if ctx.triggered else None)
        if rank is None:
            return no_update, no_update
        return [rank], "timeline"


def _register_topology(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("topology", "figure"),
        Output("slab", "figure"),
        Output("slab-box", "style"),
        Input("version", "data"),
        Input("metric", "value"),
        Input("steps", "value"),
        Input("slice-axis", "value"),
        Input("slice-index", "value"),
        Input("cp", "value"),
        Input("selected", "data"),
        Input("work", "value"),
    )
    def topology(
        version: Any,
        key: str,
        steps_value: Any,
        axis: str,
        index: Any,
        cp: Any,
        selected: Any,
        work: Any,
    ) -> tuple:
        hidden = {"display": "none"}
        if not version:
            return fig.empty_figure("loading…"), fig.empty_figure(""), hidden
        try:
            src = registry.get(version["run"])
            first, last = _steps(steps_value)
            values, m = views.colour_values(src, key, work, first, last)
            cells = views.fold_cp(values, None if cp in (None, -1) else int(cp))
            marked = _marked(views.findings(src, first, last))
        except EXPECTED as e:
            return fig.empty_figure(str(e).splitlines()[0]), fig.empty_figure(""), hidden
        slab_axis = axis if axis in fig.AXES else None
        part = fig.slice_cells(cells, slab_axis, int(index or 0) if slab_axis else None)
        selected = [int(r) for r in (selected or [])]
        figure = fig.topology_3d(
            part,
            label=m.label,
            unit=m.unit,
            marked=marked,
            selected=selected,
            high_is_bad=m.high_is_bad,
        )
        if slab_axis is None:
            return figure, fig.empty_figure(""), hidden
        slab = fig.topology_slab(
            part, slab_axis, label=m.label, unit=m.unit, marked=marked, high_is_bad=m.high_is_bad
        )
        return figure, slab, {"display": "block"}


def _register_rank_info(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("rank-info", "children"),
        Input("selected", "data"),
        Input("version", "data"),
        Input("metric", "value"),
        Input("steps", "value"),
        Input("work", "value"),
    )
    def rank_info(selected: Any, version: Any, key: str, steps_value: Any, work: Any) -> Any:
        if not version or not selected:
            return "click a rank (in the cube, a slab, the heatmap) or a finding to see its details"
        try:
            src = registry.get(version["run"])
            first, last = _steps(steps_value)
            values, m = views.colour_values(src, key, work, first, last)
            report = views.findings(src, first, last)
        except EXPECTED as e:
            return f"cannot read rank: {str(e).splitlines()[0]}"
        lines = []
        for rank in [int(r) for r in selected][:8]:
            row = values[values["rank"] == rank]
            if row.empty:
                lines.append(f"rank {rank}: not in this run")
                continue
            r = row.iloc[0]
            kinds = [f["kind"] for f in report.get("findings", []) if rank in f.get("ranks", [])]
            lines.append(
                f"rank {rank} · host {r['host']} · dp{r['dp']} pp{r['pp']} tp{r['tp']} "
                f"cp{r['cp']} · {m.label}: {r['value']:.4g} {m.unit}"
                + (f" · findings: {', '.join(kinds)}" if kinds else "")
            )
        return [dash.html.Div(line, className="rank-line") for line in lines]


def _register_heatmap(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("heatmap", "figure"),
        Input("tabs", "value"),
        Input("version", "data"),
        Input("heatmap-measure", "value"),
        Input("steps", "value"),
        Input("selected", "data"),
    )
    def heatmap(tab: str, version: Any, key: str, steps_value: Any, selected: Any) -> Any:
        if tab != "heatmap" or not version:
            return no_update
        try:
            m = views.heatmap_measure(key)
            src = registry.get(version["run"])
            first, last = _steps(steps_value)
            grid = views.rank_step_grid(src, first, last)
            report = views.findings(src, first, last)
            marked = _marked(report)
        except EXPECTED as e:
            return fig.empty_figure(str(e).splitlines()[0])
        if m.column == "blame":
            grid = views.with_blame(grid, report)
        return fig.rank_step_heatmap(
            grid, m.column, label=m.label, unit=m.unit, marked=marked, relative=key == "peers"
        )


def _register_timeline(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("timeline", "figure"),
        Input("tabs", "value"),
        Input("selected", "data"),
        Input("timeline-step", "value"),
        Input("version", "data"),
        Input("steps", "value"),
    )
    def timeline(tab: str, selected: Any, step: Any, version: Any, steps_value: Any) -> Any:
        if tab != "timeline" or not version:
            return no_update
        if not selected:
            return fig.empty_figure(
                "click a rank or a finding to see its pipeline group's timeline"
            )
        try:
            src = registry.get(version["run"])
            first, last = _steps(steps_value)
            step = last if step is None else int(step)
            picked = [int(r) for r in selected]
            ranks = views.neighbourhood(src, picked[0]) if len(picked) == 1 else picked
            ranks = ranks or picked
            spans, colls = views.timeline_rows(src, ranks, step)
            return detail.timeline(
                spans, colls, src.topology(), step=step, ranks=ranks, selected=picked
            )
        except EXPECTED as e:
            return fig.empty_figure(str(e).splitlines()[0])


def _register_links_gpu(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("links", "figure"),
        Input("tabs", "value"),
        Input("version", "data"),
        Input("steps", "value"),
    )
    def links(tab: str, version: Any, steps_value: Any) -> Any:
        if tab != "links" or not version:
            return no_update
        try:
            p2p, groups = views.links(registry.get(version["run"]), *_steps(steps_value))
        except EXPECTED as e:
            return fig.empty_figure(str(e).splitlines()[0])
        return detail.links_figure(p2p, groups)

    @app.callback(
        Output("gpu", "figure"),
        Input("tabs", "value"),
        Input("version", "data"),
        Input("steps", "value"),
        Input("selected", "data"),
    )
    def gpu(tab: str, version: Any, steps_value: Any, selected: Any) -> Any:
        if tab != "gpu" or not version:
            return no_update
        try:
            src = registry.get(version["run"])
            first, last = _steps(steps_value)
            data = views.gpu_by_rank(src, first, last)
            marked = _marked(views.findings(src, first, last))
        except EXPECTED as e:
            return fig.empty_figure(str(e).splitlines()[0])
        return detail.gpu_figure(data, marked=marked, selected=[int(r) for r in selected or []])


def _register_whatif(app: dash.Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output("whatif", "figure"),
        Output("whatif-info", "children"),
        Input("tabs", "value"),
        Input("version", "data"),
        Input("steps", "value"),
    )
    def whatif(tab: str, version: Any, steps_value: Any) -> tuple:
        if tab != "whatif" or not version:
            return no_update, no_update
        try:
            got = views.whatif(registry.get(version["run"]), *_steps(steps_value))
        except EXPECTED as e:
            got = {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}
        if "error" in got:
            line = f"no what-if for this run: {got['error']}"
            return fig.empty_figure(line), html.Div(line, className="whatif-error")
        summary = got["summary"]
        return (
            whatif_fig.whatif_figure(got["grid"], got["steps"], summary),
            whatif_fig.whatif_info(summary),
        )


def _register_plan(app: dash.Dash, registry: RunRegistry) -> None:
    """The plan tab: ``megascope plan``'s table beside the run's own layout."""

    @app.callback(
        Output("plan-view", "children"),
        Input("tabs", "value"),
        Input("version", "data"),
    )
    def plan(tab: str, version: Any) -> Any:
        if tab != "plan" or not version:
            return no_update
        from analyzer.plan import plan_run

        try:
            report = plan_run(registry.get(version["run"]).run_dir)
        except EXPECTED as e:
            return html.Div(f"no plan for this run: {str(e).splitlines()[0] if str(e) else e!r}")
        return plan_view.plan_panel(report)
