"""The plan tab: ``megascope plan``'s ranked layouts beside the run's own layout.

``plan_panel(report)`` is a pure function of the dict ``analyzer.plan.plan_run`` returns: on
the left the run's layout (measured step, its own prediction, what dominates it), on the right
the table of every layout, ranked, the run's row in bold and those that do not fit the device's
memory greyed, and under it what the model cannot predict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dash import html

GIB = 2**30
COLUMNS = ("#", "dp", "tp", "pp", "cp", "microbatches", "recompute", "sharded optimizer",
           "step ms", "MFU", "memory GiB", "fits", "dominated by")  # fmt: skip
CELL = {"padding": "2px 8px", "textAlign": "right", "borderBottom": "1px solid #eee"}


def _cells(x: Mapping[str, Any]) -> list[str]:
    fits = {True: "yes", False: "no", None: "?"}[x["fits"]]
    return [
        str(x["rank"]), str(x["dp"]), str(x["tp"]), str(x["pp"]), str(x["cp"]),
        str(x["microbatches"]), x["recompute"], "yes" if x["sharded_optimizer"] else "no",
        f"{x['predicted_step_ms']:.1f}", "" if x["mfu"] is None else f"{x['mfu']:.3f}",
        f"{x['memory_per_rank_bytes'] / GIB:.2f}", fits, x["dominant"],
    ]  # fmt: skip


def plan_table(report: Mapping[str, Any]) -> html.Table:
    """Every layout of the plan, one row each, in its rank order."""
    head = html.Tr([html.Th(c, style=CELL) for c in COLUMNS])
    rows = []
    for x in report["layouts"]:
        style = dict(CELL)
        if x["run_layout"]:
            style["fontWeight"] = "bold"
        if x["fits"] is False:
            style["color"] = "#aaa"
        rows.append(html.Tr([html.Td(c, style=style) for c in _cells(x)],
                            className="plan-own" if x["run_layout"] else "plan-row"))  # fmt: skip
    return html.Table([html.Thead(head), html.Tbody(rows)], id="plan-table",
                      style={"borderCollapse": "collapse", "fontSize": "13px"})  # fmt: skip


def own_layout(report: Mapping[str, Any]) -> html.Div:
    """The run's layout: its mesh, its measured step and what the plan predicts for it."""
    run, check = report["run"], report["self_check"]
    own = next(x for x in report["layouts"] if x["run_layout"])
    mesh = " × ".join(f"{k}{v}" for k, v in run["mesh"].items() if v > 1) or "one rank"
    measured = run["measured_step_ms"]
    err = check["error"]
    best = report["layouts"][0]
    lines = [
        html.H4("this run", style={"margin": "0 0 6px 0"}),
        html.Div(f"{mesh}, {run['global_microbatches']} microbatches of {run['micro_batch']}"),
        html.Div(f"measured step: {'?' if measured is None else f'{measured:.1f} ms'}"),
        html.Div(
            f"predicted: {own['predicted_step_ms']:.1f} ms"
            + ("" if err is None else f" ({100 * err:+.1f}%)")
        ),  # fmt: skip
        html.Div(f"ranked {own['rank']} of {len(report['layouts'])}, {own['dominant']}"),
        html.Div(
            f"fastest: dp{best['dp']} tp{best['tp']} pp{best['pp']} cp{best['cp']}, "
            f"{best['predicted_step_ms']:.1f} ms"
        ),  # fmt: skip
    ]
    return html.Div(lines, id="plan-own",
                    style={"minWidth": "230px", "padding": "8px", "background": "#f6f6f6",
                           "fontSize": "13px", "lineHeight": "1.6"})  # fmt: skip


def plan_panel(report: Mapping[str, Any]) -> html.Div:
    """The tab's content: the run's layout beside the ranked table, and the model's limits."""
    limits = html.Ul([html.Li(s) for s in report["cannot_predict"]],
                     style={"fontSize": "12px", "color": "#666"})  # fmt: skip
    return html.Div(
        [
            html.Div(
                [own_layout(report), plan_table(report)],
                style={"display": "flex", "gap": "16px", "alignItems": "flex-start"},
            ),
            html.Div("cannot predict:", style={"marginTop": "8px", "fontSize": "12px"}),
            limits,
        ]  # fmt: skip
    )
