"""Figure builders for the topology and the rank x step views: pure DataFrame -> go.Figure.

The 3D topology heatmap puts every rank at (dp, tp, pp) on (x, y, z): pipeline stages are
floors, data-parallel replicas run along the long axis, tensor-parallel peers sit side by
side. Marker size shrinks as the mesh grows, so a 192 x 8 x 8 cube stays readable; cells of
the findings' ranks get a red outline and selected ranks a cyan one. ``customdata[0]`` of
every clickable point is its rank, which the callbacks read on a click.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

AXES = ("dp", "pp", "tp")
COLORSCALE_BAD_HIGH = "YlOrRd"
COLORSCALE_BAD_LOW = "YlOrRd_r"
MARK_COLOR = "#d62728"
SELECT_COLOR = "#17becf"


def _colorscale(high_is_bad: bool) -> str:
    return COLORSCALE_BAD_HIGH if high_is_bad else COLORSCALE_BAD_LOW


def slice_cells(cells: pd.DataFrame, axis: str | None, index: int | None) -> pd.DataFrame:
    """The cells of one slab (``axis == index``), or all cells when no slice is chosen."""
    if axis is None or index is None:
        return cells
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}")
    return cells[cells[axis] == int(index)].reset_index(drop=True)


def click_ids(values: Sequence | np.ndarray) -> np.ndarray:
    """Ranks (or any ids) as a numpy array of strings for a trace's ``customdata``.

    dcc.Graph copies ``customdata[pointNumber]`` of the figure into a click's data, which
    fails on plotly's base64 typed arrays (numeric numpy arrays are sent that way); strings go
    as a JSON list, and plotly validates a numpy array without walking it in Python (a list
    of 12,288 lists costs seconds)."""
    return np.asarray(values).astype(str)


def _hover(unit: str) -> str:
    """Rank from ``customdata``, host from ``text``, value from the marker colour."""
    return (
        "rank %{customdata}<br>host %{text}<br>dp %{x} · pp %{z} · tp %{y}<br>"
        "%{marker.color:.4g} " + unit + "<extra></extra>"
    )


def _marker_size(cells: pd.DataFrame) -> int:
    longest = max(int(cells[a].max()) + 1 for a in AXES) if len(cells) else 1
    return int(np.clip(140 / longest, 3, 22))


def _outline(
    cells: pd.DataFrame, ranks: Sequence[int], name: str, color: str, size: int, symbol: str
) -> dict:
    hit = cells[cells["rank"].isin([int(r) for r in ranks])]
    return dict(
        type="scatter3d",
        x=hit["dp"],
        y=hit["tp"],
        z=hit["pp"],
        mode="markers",
        name=name,
        marker={
            "symbol": symbol,
            "size": size,
            "color": color,
            "line": {"color": color, "width": 4},
        },
        customdata=click_ids(hit["rank"]),
        text=click_ids(hit["host"]),
        hovertemplate=name + ": rank %{customdata} (%{text})<extra></extra>",
    )


def topology_3d(
    cells: pd.DataFrame,
    *,
    label: str,
    unit: str,
    marked: Sequence[int] = (),
    selected: Sequence[int] = (),
    high_is_bad: bool = True,
) -> go.Figure:
    """The 3D heatmap: ``cells`` has rank, host, dp, pp, tp, value (one row per cell).

    Trace 0 holds the cells with a value, coloured by it; cells without data (a rank that
    never reported) are grey in trace 1; then the outlines of ``marked`` (the findings'
    ranks) and ``selected`` ranks.
    """
    size = _marker_size(cells)
    has = cells[cells["value"].notna()]
    none = cells[cells["value"].isna()]
    traces = [
        _valued_cells(has, label, unit, size, high_is_bad),
        _cells_without_data(none, size),
        _outline(cells, marked, "finding", MARK_COLOR, size + 6, "square-open"),
        _outline(cells, selected, "selected", SELECT_COLOR, size + 10, "circle-open"),
    ]
    layout = _cube_layout(cells, label, unit)
    # traces as dicts: plotly validates them once, without deep-copying trace objects
    # (0.1 s instead of 0.6 s at 12,288 ranks)
    return go.Figure(data=traces, layout=layout)


def _valued_cells(has: pd.DataFrame, label: str, unit: str, size: int, high_is_bad: bool) -> dict:
    """The cells with a value, coloured by it (trace 0 of the cube)."""
    return dict(
        type="scatter3d",
        x=has["dp"],
        y=has["tp"],
        z=has["pp"],
        mode="markers",
        name=label,
        marker={
            "symbol": "square",
            "size": size,
            "color": has["value"],
            "opacity": 1.0,
            "colorscale": _colorscale(high_is_bad),
            "showscale": True,
            "colorbar": {"title": {"text": unit}, "thickness": 14},
            "line": {"width": 1, "color": "rgba(60, 60, 60, 0.35)"},
        },
        customdata=click_ids(has["rank"]),
        text=click_ids(has["host"]),
        hovertemplate=_hover(unit),
    )


def _cells_without_data(none: pd.DataFrame, size: int) -> dict:
    """The cells of ranks that never reported, grey (trace 1 of the cube)."""
    return dict(
        type="scatter3d",
        x=none["dp"],
        y=none["tp"],
        z=none["pp"],
        mode="markers",
        name="no data",
        marker={"symbol": "square", "size": size, "color": "#bbbbbb"},
        customdata=click_ids(none["rank"]),
        text=click_ids(none["host"]),
        hovertemplate="rank %{customdata}<br>host %{text}<br>no data<extra></extra>",
    )


def _cube_layout(cells: pd.DataFrame, label: str, unit: str) -> dict:
    """The cube's scene: an axis per mesh dimension, scaled to its extent, and the title."""
    extent = {a: (int(cells[a].max()) + 1 if len(cells) else 1) for a in AXES}
    longest = max(extent.values())
    ratio = {a: max(0.3, extent[a] / longest) for a in AXES}
    scene_axis = {"backgroundcolor": "#f4f4f4", "gridcolor": "#dddddd", "zeroline": False}

    def axis(name: str, title: str) -> dict:
        n = extent[name]
        return {
            **scene_axis,
            "title": {"text": title},
            "range": [-0.6, n - 0.4],
            "dtick": 1 if n <= 16 else None,
        }

    return dict(
        scene={
            "xaxis": axis("dp", "dp"),
            "yaxis": axis("tp", "tp"),
            "zaxis": axis("pp", "pp (stage)"),
            "aspectmode": "manual",
            "aspectratio": {"x": ratio["dp"], "y": ratio["tp"], "z": ratio["pp"]},
            "camera": {"eye": {"x": 1.25, "y": -1.25, "z": 0.85}},
        },
        margin={"l": 0, "r": 0, "t": 36, "b": 0},
        title={"text": f"{label} ({unit})", "x": 0.02, "font": {"size": 14}},
        legend={"orientation": "h", "y": 0.0, "x": 0.0},
        uirevision="topology",
    )


def topology_slab(
    cells: pd.DataFrame,
    axis: str,
    *,
    label: str,
    unit: str,
    marked: Sequence[int] = (),
    high_is_bad: bool = True,
) -> go.Figure:
    """One slab of the cube as a 2D heatmap: the two axes other than ``axis``.

    ``cells`` must already be cut by :func:`slice_cells`; each heatmap cell carries its rank
    in ``customdata`` so a click selects it, and the findings' ranks get a red ``x``.
    """
    rows, cols = [a for a in ("pp", "dp", "tp") if a != axis][:2]
    n_rows = int(cells[rows].max()) + 1 if len(cells) else 0
    n_cols = int(cells[cols].max()) + 1 if len(cells) else 0
    z = np.full((n_rows, n_cols), np.nan)
    rank = np.full((n_rows, n_cols), -1)
    for r, c, v, k in zip(cells[rows], cells[cols], cells["value"], cells["rank"], strict=True):
        z[int(r), int(c)] = v
        rank[int(r), int(c)] = k
    fig = go.Figure(
        go.Heatmap(
            z=z,
            customdata=click_ids(rank),
            colorscale=_colorscale(high_is_bad),
            colorbar={"title": {"text": unit}, "thickness": 14},
            hovertemplate=f"rank %{{customdata}}<br>{cols} %{{x}} · {rows} %{{y}}<br>"
            f"%{{z:.3g}} {unit}<extra></extra>",
        )
    )
    hit = cells[cells["rank"].isin([int(r) for r in marked])]
    fig.add_trace(
        go.Scatter(
            x=hit[cols],
            y=hit[rows],
            mode="markers",
            name="finding",
            marker={
                "symbol": "x-thin-open",
                "size": 16,
                "color": MARK_COLOR,
                "line": {"width": 3, "color": MARK_COLOR},
            },
            customdata=click_ids(hit["rank"]),
            hovertemplate="finding: rank %{customdata}<extra></extra>",
        )
    )
    fig.update_layout(
        xaxis={"title": {"text": cols}, "dtick": 1 if n_cols <= 32 else None},
        yaxis={"title": {"text": rows}, "dtick": 1 if n_rows <= 32 else None},
        margin={"l": 50, "r": 10, "t": 36, "b": 40},
        title={"text": f"slab: {label} ({unit})", "x": 0.02, "font": {"size": 14}},
        showlegend=False,
    )
    return fig


def _bin_label(row: pd.Series) -> str:
    hosts = (
        row["host_lo"] if row["host_lo"] == row["host_hi"] else f"{row['host_lo']}…{row['host_hi']}"
    )
    ranks = (
        f"r{row['rank_lo']}"
        if row["rank_lo"] == row["rank_hi"]
        else f"r{row['rank_lo']}-{row['rank_hi']}"
    )
    return f"{hosts} {ranks}"


def rank_step_heatmap(
    grid: pd.DataFrame,
    column: str,
    *,
    label: str,
    unit: str,
    marked: Sequence[int] = (),
    relative: bool = False,
) -> go.Figure:
    """MegaScale's heatmap: one row per rank (or bin of ranks, grouped by host), one column
    per step (or bin of steps). ``grid`` comes from ``rank_step_grid.sql``; a binned cell
    shows the worst rank of its bin, named in the hover and in ``customdata`` for clicks.
    Rows holding a finding's rank are labelled with a red ◆ on the axis. A ``relative``
    measure (a ratio to the peers' median) starts its colour scale at 1.0 and spans at least
    1.0-1.25, so a healthy run's noise stays pale and only a rank slower than its peers is
    coloured."""
    if grid.empty:
        return empty_figure("no steps in this range")
    rows = grid.drop_duplicates("rbin").set_index("rbin").sort_index()
    marked_set = {int(r) for r in marked}
    labels = []
    for _, row in rows.iterrows():
        hit = any(row["rank_lo"] <= r <= row["rank_hi"] for r in marked_set)
        labels.append(("◆ " if hit else "") + _bin_label(row))
    steps = grid.drop_duplicates("sbin").set_index("sbin").sort_index()
    x = [
        f"{a}" if a == b else f"{a}-{b}"
        for a, b in zip(steps["step_lo"], steps["step_hi"], strict=True)
    ]
    pos_r = {b: i for i, b in enumerate(rows.index)}
    pos_s = {b: i for i, b in enumerate(steps.index)}
    z = np.full((len(rows), len(steps)), np.nan)
    worst = np.full((len(rows), len(steps)), -1)
    for rb, sb, v, w in zip(
        grid["rbin"], grid["sbin"], grid[column], grid["worst_rank"], strict=True
    ):
        z[pos_r[rb], pos_s[sb]] = v
        worst[pos_r[rb], pos_s[sb]] = w
    scale: dict[str, float] = {}
    if relative:
        top = float(np.nanmax(z)) if np.isfinite(z).any() else 1.0
        scale = {"zmin": 1.0, "zmax": max(1.25, top)}
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=x,
            y=labels,
            customdata=click_ids(worst),
            colorscale=COLORSCALE_BAD_HIGH,
            colorbar={"title": {"text": unit}, "thickness": 14},
            **scale,
            hovertemplate="%{y}<br>step %{x}<br>%{z:.3g} "
            + unit
            + "<br>worst rank %{customdata}<extra></extra>",
        )
    )
    fig.update_layout(
        xaxis={"title": {"text": "step"}, "type": "category"},
        yaxis={"autorange": "reversed", "type": "category", "tickfont": {"size": 10}},
        margin={"l": 10, "r": 10, "t": 36, "b": 40},
        title={"text": f"rank × step: {label} ({unit})", "x": 0.02, "font": {"size": 14}},
    )
    return fig


def empty_figure(message: str) -> go.Figure:
    """A blank figure that says why it is blank."""
    fig = go.Figure()
    fig.add_annotation(
        text=message,
        showarrow=False,
        font={"size": 14, "color": "#666"},
        xref="paper",
        yref="paper",
        x=0.5,
        y=0.5,
    )
    fig.update_layout(
        xaxis={"visible": False},
        yaxis={"visible": False},
        margin={"l": 10, "r": 10, "t": 10, "b": 10},
    )
    return fig
