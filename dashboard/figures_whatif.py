"""The what-if view's figure (pure): the per-worker slowdown grid and the per-step slowdown.

Left, the study's per-worker heatmap (ByteDance Seed, OSDI 2025, figure 14): one cell per
(dp rank, pipeline stage), coloured by the slowdown S of the ideal replay in which only that
worker keeps its measured durations; a cell that was not replayed (a big run's grid is bounded,
see :mod:`analyzer.whatif.views`) stays blank. ``customdata`` of a cell is its first rank, so a
click selects it as in the other views. Right, each step's measured replay over its ideal
replay, with the run's S as a dashed line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.figures import COLORSCALE_BAD_HIGH, MARK_COLOR, click_ids, empty_figure

LABELLED_CELLS = 64  # up to this many cells, each shows its S


def _right_of(fig: go.Figure) -> float:
    """Just right of the heatmap's plot area (paper coordinates), for its colour bar."""
    return float(fig.layout.xaxis.domain[1]) + 0.01


def _grid_arrays(grid: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(S, first rank as text, hover text) as (stages, dp ranks) arrays."""
    n_dp = int(grid["dp"].max()) + 1
    n_pp = int(grid["pp"].max()) + 1
    z = np.full((n_pp, n_dp), np.nan)
    rank = np.full((n_pp, n_dp), -1, dtype=np.int64)
    text = np.full((n_pp, n_dp), "no operations", dtype=object)
    for row in grid.itertuples(index=False):
        dp, pp = int(row.dp), int(row.pp)
        rank[pp, dp] = int(row.first_rank)
        n, first = int(row.ranks), int(row.first_rank)
        ranks = f"rank {first}" if n == 1 else f"{n} ranks, the first {first}"
        if row.replayed:
            z[pp, dp] = float(row.slowdown)
            text[pp, dp] = f"S = {row.slowdown:.4f}<br>{ranks}"
        else:
            text[pp, dp] = f"not replayed (smaller excess)<br>{ranks}"
    return z, click_ids(rank), text


def whatif_figure(grid: pd.DataFrame, steps: pd.DataFrame, summary: Mapping[str, Any]) -> go.Figure:
    """Heatmap of ``grid`` (``worker_grid``: dp, pp, first_rank, ranks, replayed, slowdown)
    beside the bars of ``steps`` (``per_step``: step, measured_s, ideal_s, slowdown)."""
    if grid.empty and steps.empty:
        return empty_figure("nothing to replay")
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        horizontal_spacing=0.12,
        subplot_titles=("S per worker (dp rank × stage)", "S per step (measured / ideal)"),
    )
    if not grid.empty:
        z, custom, text = _grid_arrays(grid)
        shown = z[np.isfinite(z)]
        lo = min(1.0, float(shown.min())) if len(shown) else 1.0
        hi = max(lo + 1e-3, float(shown.max())) if len(shown) else lo + 1e-3
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=list(range(z.shape[1])),
                y=list(range(z.shape[0])),
                customdata=custom,
                text=text,
                zmin=lo,
                zmax=hi,
                colorscale=COLORSCALE_BAD_HIGH,
                colorbar={
                    "title": {"text": "S"},
                    "thickness": 14,
                    "x": _right_of(fig),
                    "xanchor": "left",
                },
                texttemplate="%{z:.3f}" if z.size <= LABELLED_CELLS else None,
                hovertemplate="dp %{x} · stage %{y}<br>%{text}<extra></extra>",
                name="S per worker",
            ),
            row=1,
            col=1,
        )
        fig.update_xaxes(title_text="dp rank", dtick=1 if z.shape[1] <= 32 else None, row=1, col=1)
        fig.update_yaxes(
            title_text="stage (pp)", dtick=1 if z.shape[0] <= 32 else None, row=1, col=1
        )
    if not steps.empty:
        x = [str(int(s)) for s in steps["step"]]
        hover = [
            f"step {s}<br>S = {r:.4f}<br>measured {m * 1e3:.4g} ms · ideal {i * 1e3:.4g} ms"
            for s, r, m, i in zip(
                x, steps["slowdown"], steps["measured_s"], steps["ideal_s"], strict=True
            )
        ]
        fig.add_trace(
            go.Bar(x=x, y=steps["slowdown"], name="S per step", marker={"color": "#1f77b4"},
                   hovertext=hover, hoverinfo="text"),
            row=1,
            col=2,
        )  # fmt: skip
        s = summary.get("slowdown")
        if s is not None and np.isfinite(s):
            fig.add_trace(
                go.Scatter(x=[x[0], x[-1]], y=[s, s], mode="lines", name=f"run S = {s:.3f}",
                           line={"color": MARK_COLOR, "dash": "dash"}, hoverinfo="name"),
                row=1,
                col=2,
            )  # fmt: skip
        low = float(np.nanmin(steps["slowdown"])) if steps["slowdown"].notna().any() else 1.0
        fig.update_yaxes(title_text="S", range=[min(1.0, low) * 0.98, None], row=1, col=2)
        fig.update_xaxes(title_text="step", type="category", row=1, col=2)
    fig.update_layout(
        title={"text": _title(summary), "x": 0.02, "font": {"size": 14}},
        margin={"l": 50, "r": 10, "t": 70, "b": 40},
        legend={"orientation": "h", "y": -0.15, "x": 0.55},
        bargap=0.15,
    )
    return fig


def _title(summary: Mapping[str, Any]) -> str:
    s, t, i = summary.get("slowdown"), summary.get("t_measured_s"), summary.get("t_ideal_s")
    if s is None or t is None or i is None or not np.isfinite(s):
        return "what-if"
    return (
        f"what-if: slowdown S = {s:.3f} (measured {t * 1e3:.4g} ms, ideal {i * 1e3:.4g} ms "
        f"per step; saving {1 - 1 / s:.1%})"
    )


def whatif_info(summary: Mapping[str, Any]) -> str:
    """The panel's one line above the figure."""
    parts = [f"{summary.get('steps', 0)} steps replayed"]
    left = summary.get("steps_left_out") or []
    if left:
        shown = ", ".join(str(s) for s in left[:8]) + (" …" if len(left) > 8 else "")
        parts.append(f"{len(left)} left out (other operations than the rest: {shown})")
    cells, replayed = summary.get("cells", 0), summary.get("cells_replayed", 0)
    if replayed < cells:
        parts.append(
            f"{replayed} of {cells} workers replayed (those that exceed their typical "
            "durations the most; the others are blank)"
        )
    else:
        parts.append(f"{cells} workers")
    return " · ".join(parts)
