"""Figure builders for the detail views: timeline, links, GPU telemetry (pure functions).

The timeline draws one row per rank: compute/data spans as bars, collectives as thinner bars
coloured by group, and a line through the *arrival* (issue time) of every member of the
same collective (same group instance and ``seq``), so the rank that arrived last, the one
everyone waited for, is where the lines bend. A send is linked to its matching recv (same
pair and seq) from the send's issue to the recv's end. A collective that never completed
(``end_ns`` null) runs to the right edge in red. Spans that ran on a stream or thread of their
own (an optimizer offload's copies and host updates: ``stream`` set) get a row of their own
under their rank's, one per stream (``r0 … · copy``), since they overlap the rank's compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.figures import MARK_COLOR, SELECT_COLOR, click_ids, empty_figure

SPAN_COLORS = {"compute": "#1f77b4", "data": "#9467bd", "host": "#7f7f7f", "comm": "#8c564b",
               "offload": "#17becf"}  # fmt: skip
GROUP_COLORS = {"tp": "#ff7f0e", "dp": "#2ca02c", "pp": "#e377c2", "cp": "#bcbd22"}


def collective_links(colls: pd.DataFrame) -> list[tuple[str, list[tuple[int, int]]]]:
    """Match the same collective across the shown ranks, by the analyzer's keys.

    ``colls`` has rank, op, group_name, gid, src, dst, seq, start_ns (arrival), end_ns.
    Returns ``(group, [(rank, t_ns), ...])`` per collective seen on at least two ranks: for
    a group collective (key group, gid, seq) every member's arrival; for a send/recv pair
    (key group, src, dst, seq) the send's arrival and the recv's end.
    """
    points: dict[tuple, list[tuple[int, int]]] = {}
    for row in colls.itertuples(index=False):
        if row.op in ("send", "recv"):
            key = (row.group_name, "p2p", int(row.src), int(row.dst), int(row.seq))
            t = row.start_ns if row.op == "send" else row.end_ns
        else:
            key = (row.group_name, "group", int(row.gid), -1, int(row.seq))
            t = row.start_ns
        if pd.isna(t):
            continue
        points.setdefault(key, []).append((int(row.rank), int(t)))
    return [(str(k[0]), sorted(v)) for k, v in points.items() if len(v) >= 2]


def _row_label(rank: int, coords: Mapping[int, Mapping[str, int]]) -> str:
    c = coords.get(rank)
    return f"r{rank} dp{c['dp']} pp{c['pp']} tp{c['tp']}" if c else f"r{rank}"


def _bars(
    df: pd.DataFrame,
    labels: dict[int, str],
    t0: int,
    t_end: int,
    name: str,
    color: str,
    width: float,
    hover: list[str],
    y: list[str] | None = None,
) -> go.Bar:
    end = df["end_ns"].fillna(t_end).astype("int64")
    return go.Bar(
        y=y if y is not None else [labels[int(r)] for r in df["rank"]],
        x=(end - df["start_ns"]) / 1e6,
        base=(df["start_ns"] - t0) / 1e6,
        orientation="h",
        name=name,
        width=width,
        marker={"color": color},
        hovertext=hover,
        hoverinfo="text",
        customdata=click_ids(df["rank"]),
    )


def timeline(
    spans: pd.DataFrame,
    colls: pd.DataFrame,
    topo: pd.DataFrame,
    *,
    step: int,
    ranks: Sequence[int],
    selected: Sequence[int] = (),
) -> go.Figure:
    """One step of the given ranks on one clock (ms from the first event shown)."""
    if spans.empty and colls.empty:
        return empty_figure(f"no spans or collectives for these ranks at step {step}")
    coords = topo.set_index("rank")[["dp", "pp", "tp", "cp"]].to_dict("index")
    chosen = {int(r) for r in selected}
    labels = {
        int(r): ("▶ " if int(r) in chosen else "") + _row_label(int(r), coords) for r in ranks
    }
    starts = pd.concat([spans["start_ns"], colls["start_ns"]]).dropna()
    ends = pd.concat([spans["end_ns"], colls["end_ns"]]).dropna()
    t0, t_end = int(starts.min()), int(max(ends.max(), starts.max()))
    fig = go.Figure()
    laned = spans["stream"].notna() if "stream" in spans.columns else spans["kind"].isna()
    lanes = _add_lanes(fig, spans[laned], labels, t0, t_end)
    _add_span_bars(fig, spans[~laned], labels, t0, t_end)
    _add_collective_bars(fig, colls, labels, t0, t_end)
    _add_links(fig, collective_links(colls), labels, t0)
    _timeline_layout(fig, step, ranks, labels, lanes)
    return fig


def _add_span_bars(
    fig: go.Figure, spans: pd.DataFrame, labels: dict[int, str], t0: int, t_end: int
) -> None:
    """The spans without a stream as bars on their rank's row, a trace per kind."""
    for kind, part in spans.groupby("kind", sort=True):
        hover = [
            f"r{r} {n} ({k}) {(e - s) / 1e6:.2f} ms"
            for r, n, k, s, e in zip(
                part["rank"],
                part["name"],
                part["kind"],
                part["start_ns"],
                part["end_ns"].fillna(t_end),
                strict=True,
            )
        ]
        fig.add_trace(
            _bars(
                part,
                labels,
                t0,
                t_end,
                f"span: {kind}",
                SPAN_COLORS.get(str(kind), "#7f7f7f"),
                0.7,
                hover,
            )
        )


def _add_collective_bars(
    fig: go.Figure, colls: pd.DataFrame, labels: dict[int, str], t0: int, t_end: int
) -> None:
    """The completed collectives as bars, a trace per group, and those never completed."""
    for group, part in colls.groupby("group_name", sort=True):
        done = part[part["end_ns"].notna()]
        hover = [
            f"r{r} {op} {g} seq {q} {(e - s) / 1e6:.2f} ms"
            for r, op, g, q, s, e in zip(
                done["rank"],
                done["op"],
                done["group_name"],
                done["seq"],
                done["start_ns"],
                done["end_ns"],
                strict=True,
            )
        ]
        fig.add_trace(
            _bars(
                done,
                labels,
                t0,
                t_end,
                f"collective: {group}",
                GROUP_COLORS.get(str(group), "#8c564b"),
                0.35,
                hover,
            )
        )
    open_ = colls[colls["end_ns"].isna()]
    if len(open_):
        hover = [
            f"r{r} {op} {g} seq {q}: never completed"
            for r, op, g, q in zip(
                open_["rank"], open_["op"], open_["group_name"], open_["seq"], strict=True
            )
        ]
        fig.add_trace(_bars(open_, labels, t0, t_end, "never completed", MARK_COLOR, 0.35, hover))


def _timeline_layout(
    fig: go.Figure,
    step: int,
    ranks: Sequence[int],
    labels: dict[int, str],
    lanes: dict[int, list[str]],
) -> None:
    """The rows in the ranks' order (each rank's stream lanes below it), the axes, the title."""
    order = [
        row
        for r in ranks
        for row in [labels[int(r)], *(f"{labels[int(r)]} · {st}" for st in lanes.get(int(r), []))]
    ]
    fig.update_layout(
        barmode="overlay",
        xaxis={"title": {"text": "ms since the first event shown"}},
        yaxis={
            "categoryorder": "array",
            "categoryarray": order[::-1],
            "type": "category",
            "tickfont": {"color": "#000"},
        },
        margin={"l": 10, "r": 10, "t": 36, "b": 40},
        title={
            "text": f"step {step}: ranks {', '.join(str(r) for r in ranks[:12])}"
            + (" …" if len(ranks) > 12 else ""),
            "x": 0.02,
            "font": {"size": 14},
        },
        legend={"orientation": "h", "y": -0.2},
    )


def _add_lanes(
    fig: go.Figure, spans: pd.DataFrame, labels: dict[int, str], t0: int, t_end: int
) -> dict[int, list[str]]:
    """Spans with a ``stream`` as bars on a row per (rank, stream) below the rank's row,
    coloured by direction; returns each rank's streams in order."""
    lanes: dict[int, list[str]] = {}
    if spans.empty:
        return lanes
    for (rank, stream), _ in spans.groupby(["rank", "stream"], sort=True):
        lanes.setdefault(int(rank), []).append(str(stream))
    colors = {"d2h": "#17becf", "h2d": "#2ca02c", "host_update": "#bcbd22"}
    for direction, part in spans.groupby(spans["direction"].fillna(""), sort=True):
        hover = [
            f"r{r} {n} ({d}, {st}) {(e - s) / 1e6:.2f} ms"
            + ("" if pd.isna(b) else f", {int(b):,} bytes")
            for r, n, d, st, s, e, b in zip(
                part["rank"],
                part["name"],
                part["direction"],
                part["stream"],
                part["start_ns"],
                part["end_ns"].fillna(t_end),
                part["nbytes"],
                strict=True,
            )
        ]
        y = [f"{labels[int(r)]} · {st}" for r, st in zip(part["rank"], part["stream"], strict=True)]
        fig.add_trace(
            _bars(
                part,
                labels,
                t0,
                t_end,
                f"offload: {direction or 'other'}",
                colors.get(str(direction), SPAN_COLORS["offload"]),
                0.7,
                hover,
                y=y,
            )
        )
    return lanes


def _add_links(
    fig: go.Figure,
    links: list[tuple[str, list[tuple[int, int]]]],
    labels: Mapping[int, str],
    t0: int,
) -> None:
    """One line trace per group: members' points joined, ``None`` between collectives."""
    by_group: dict[str, tuple[list, list]] = {}
    for group, points in links:
        xs, ys = by_group.setdefault(group, ([], []))
        for rank, t in points:
            if rank in labels:
                xs.append((t - t0) / 1e6)
                ys.append(labels[rank])
        xs.append(None)
        ys.append(None)
    for group, (xs, ys) in sorted(by_group.items()):
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines+markers",
                name=f"link: {group}",
                line={"color": GROUP_COLORS.get(group, "#555"), "width": 1, "dash": "dot"},
                marker={"size": 4},
                hoverinfo="skip",
            )
        )


def links_figure(p2p: pd.DataFrame, groups: pd.DataFrame, *, slowest: int = 20) -> go.Figure:
    """Left: the slowest pipeline pairs (bars) against the median of all pairs (line).
    Right: every process group's bus bandwidth, one box per axis with every group a point."""
    if p2p.empty and groups.empty:
        return empty_figure("no point-to-point transfers or group collectives in this range")
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.45, 0.55],
        subplot_titles=("slowest pipeline pairs (GB/s)", "process groups: bus bandwidth (GB/s)"),
    )
    if len(p2p):
        worst = p2p.nsmallest(slowest, "gbps").iloc[::-1]
        names = [f"{s}→{d}" for s, d in zip(worst["src"], worst["dst"], strict=True)]
        fig.add_trace(
            go.Bar(
                x=worst["gbps"],
                y=names,
                orientation="h",
                name="pair",
                marker={"color": "#e377c2"},
                customdata=click_ids(worst["src"]),
                hovertemplate="%{y}: %{x:.3g} GB/s<extra></extra>",
            ),
            row=1,
            col=1,
        )
        median = float(p2p["gbps"].median())
        fig.add_vline(
            x=median,
            line={"dash": "dash", "color": "#333"},
            row=1,
            col=1,
            annotation_text=f"median {median:.3g}",
            annotation_position="top",
        )
    for name, part in groups.groupby("group_name", sort=True):
        fig.add_trace(
            go.Box(
                y=part["gbps"],
                name=str(name),
                boxpoints="all",
                jitter=0.4,
                pointpos=0,
                marker={"color": GROUP_COLORS.get(str(name), "#555"), "size": 5},
                customdata=click_ids(part["first_rank"]),
                hovertemplate=f"{name} group from rank %{{customdata}}: %{{y:.3g}} GB/s<extra></extra>",
            ),
            row=1,
            col=2,
        )
    fig.update_layout(showlegend=False, margin={"l": 10, "r": 10, "t": 40, "b": 30})
    return fig


GPU_PANELS = (
    ("sm_clock_mhz", "SM clock (MHz)"),
    ("power_w", "power (W)"),
    ("temp_c", "temperature (°C)"),
    ("util_gpu", "utilization (%)"),
)


def gpu_figure(
    gpu: pd.DataFrame, *, marked: Sequence[int] = (), selected: Sequence[int] = ()
) -> go.Figure:
    """Four panels, one point per rank: SM clock, power, temperature, utilization over the
    step range; findings' ranks in red, selected ones in cyan."""
    if gpu.empty:
        return empty_figure("no GPU telemetry in this run (CPU run, or NVML unavailable)")
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=[t for _, t in GPU_PANELS],
        shared_xaxes=True,
        vertical_spacing=0.12,
    )
    colors = np.where(
        gpu["rank"].isin(list(marked)),
        MARK_COLOR,
        np.where(gpu["rank"].isin(list(selected)), SELECT_COLOR, "#1f77b4"),
    )
    for i, (col, title) in enumerate(GPU_PANELS):
        fig.add_trace(
            go.Scattergl(
                x=gpu["rank"],
                y=gpu[col],
                mode="markers",
                name=title,
                marker={"color": colors, "size": 6},
                customdata=click_ids(gpu["rank"]),
                text=gpu["host"],
                hovertemplate="rank %{x} (%{text}): %{y:.4g}<extra></extra>",
            ),
            row=i // 2 + 1,
            col=i % 2 + 1,
        )
    fig.update_xaxes(title_text="rank", row=2)
    fig.update_layout(showlegend=False, margin={"l": 10, "r": 10, "t": 40, "b": 30})
    return fig
