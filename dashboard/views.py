"""The data behind each view: known metrics mapped to known SQL files, one value per rank.

Nothing here builds a figure and nothing takes SQL from the browser: a metric chosen on the
page is a key of :data:`METRICS`, which names the ``.sql`` file and the column to read; an
unknown key is refused. Step ranges, ranks and bin counts reach DuckDB as bound parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from dashboard.source import RunSource, blame_by_rank

COORDS = ("dp", "pp", "tp", "cp")


@dataclass(frozen=True)
class Metric:
    """A colour the 3D heatmap can show: where its numbers come from and which way is bad."""

    label: str
    unit: str
    sql: str | None  # dashboard/sql/<sql>.sql returning rank + column; None: from the findings
    column: str = "value"
    high_is_bad: bool = True


# The 3D view opens on ``peers``, the finding's own measure: each rank's own time over its
# stage peers' in each step, as the rank x step heatmap computes it (rank_step_grid.sql, read
# with one bin per rank and one over the steps: :func:`peer_values`), so that the rank a
# finding names is the darkest cell. Compute time counts the time a rank's spans wait inside
# for a slow peer (tensor-parallel collectives), so there its peers can read darker.
METRICS: dict[str, Metric] = {
    "peers": Metric(
        "own time over its stage peers' (mean over the steps)",
        "× peers",
        "rank_step_grid",
        "peer_ratio",
    ),
    "compute": Metric("compute time per step", "ms", "metric_compute"),
    "blame": Metric("step time blamed on the rank by the analyzer", "%", None),
    "comm": Metric("time in collectives per step (waiting + transfer)", "ms", "metric_comm"),
    "exposed": Metric("exposed communication per step", "ms", "metric_exposed"),
    "step": Metric("step wall time", "ms", "metric_step"),
    "busbw": Metric("bus bandwidth of its collectives", "GB/s", "metric_busbw", high_is_bad=False),
    "sm_clock": Metric("GPU SM clock", "MHz", "metric_gpu", "sm_clock_mhz", high_is_bad=False),
    "temp": Metric("GPU temperature", "°C", "metric_gpu", "temp_c"),
    "power": Metric("GPU power", "W", "metric_gpu", "power_w"),
    "util": Metric("GPU utilization", "%", "metric_gpu", "util_gpu", high_is_bad=False),
    # each rank coloured by its hardware class (topology's hw_class): the class's own time
    # over the fastest class's, so the ranks of a slower class stand out together
    "hw_class": Metric("hardware class, its time over the fastest class's", "×", "metric_hw_class"),
}

# What the 3D view can show instead of a time: the work each rank was given (the run's
# ``work`` table), as its ratio to the median rank's, so that a rank given more work is told
# from a rank slower at the same work. Keys are dash_work kinds (work_digest.sql).
WORK_METRICS: dict[str, Metric] = {
    "tokens": Metric("tokens per step, ratio to the median rank", "× median", "work_ratio"),
    "expert_tokens": Metric(
        "tokens routed to its experts per step, ratio to the median rank", "× median", "work_ratio"
    ),
    "a2a_recv": Metric(
        "all_to_all bytes received per step, ratio to the median rank", "× median", "work_ratio"
    ),
}
WORK_LABELS = {"tokens": "tokens", "expert_tokens": "expert tokens", "a2a_recv": "a2a bytes in"}
METRIC_DEFAULT = "peers"  # what the 3D view opens on
TIME = "time"  # the work choice that keeps the time metric of the "colour by" control

# What the rank x step heatmap can be coloured by: a column of rank_step_grid.sql (or the
# analyzer's blame, the same in every step). The default, ``peers``, is each rank's own time
# over its stage peers' in the same step (rank_step_peer.sql), so that a slow rank's row stands
# out even where its peers wait for it and every step time is equal (MegaScale's heatmap).
HEATMAP_MEASURES: dict[str, Metric] = {
    "peers": Metric(
        "own time over its stage peers' in the step (median over its compute spans)",
        "× peers",
        None,
        "peer_ratio",
    ),
    "own": Metric("own time per step (step minus collectives)", "ms", None, "own_ms"),
    "compute": Metric("compute time per step", "ms", None, "compute_ms"),
    "step": Metric("step wall time", "ms", None, "step_ms"),
    "comm": Metric("time in collectives per step (waiting + transfer)", "ms", None, "comm_ms"),
    "exposed": Metric("exposed communication per step", "ms", None, "exposed_ms"),
    "blame": Metric("step time blamed on the rank by the analyzer", "%", None, "blame"),
}
HEATMAP_DEFAULT = "peers"


def metric(key: str) -> Metric:
    """The metric of a key sent by the browser; ValueError for anything else."""
    try:
        return METRICS[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown metric {key!r}") from None


def step_bounds(src: RunSource) -> tuple[int, int]:
    """First and last step with data ((0, 0) for a run without steps yet)."""
    row = src.query("step_bounds").iloc[0]
    if pd.isna(row["first_step"]):
        return 0, 0
    return int(row["first_step"]), int(row["last_step"])


def findings(src: RunSource, first: int, last: int) -> dict:
    """The analyzer's report for the chosen steps; over the whole run the analyzer picks its
    own window (it leaves out warm-up steps), so the page agrees with ``megascope analyze``."""
    whole = (first, last) == step_bounds(src)
    return src.findings(None if whole else (first, last))


def rank_values(src: RunSource, key: str, first: int, last: int) -> pd.DataFrame:
    """rank, host, dp, pp, tp, cp, value: one row per rank (value NaN where it has no data)."""
    m = metric(key)
    topo = src.topology()
    if m.sql is None:
        blame = blame_by_rank(findings(src, first, last))
        values = pd.DataFrame({"rank": list(blame), "value": [100.0 * v for v in blame.values()]})
        out = topo.merge(values, on="rank", how="left")
        out["value"] = out["value"].fillna(0.0)
        return out
    if m.sql == "rank_step_grid":
        return peer_values(src, first, last, m.column)
    got = src.query(m.sql, first=first, last=last)[["rank", m.column]]
    return topo.merge(got.rename(columns={m.column: "value"}), on="rank", how="left")


def peer_values(src: RunSource, first: int, last: int, column: str = "peer_ratio") -> pd.DataFrame:
    """rank, host, dp, pp, tp, cp, value: each rank's ``column`` of the rank x step heatmap
    (:func:`rank_step_grid`) over the steps ``first..last``, read with one bin per rank and
    one bin of steps: the heatmap's own computation, so that the 3D view and the heatmap agree."""
    topo = src.topology()
    grid = rank_step_grid(src, first, last, rank_bins=len(topo), step_bins=1)
    got = pd.DataFrame({"rank": grid["rank_lo"].astype(int), "value": grid[column]})
    return topo.merge(got, on="rank", how="left")


def work_kinds(src: RunSource) -> list[str]:
    """The work kinds of :data:`WORK_METRICS` the run has, in that order (none without a
    ``work`` table)."""
    have = set(src.query("work_kinds")["kind"])
    return [k for k in WORK_METRICS if k in have]


def work_metric(kind: str) -> Metric:
    """The metric of a work kind sent by the browser; ValueError for anything else."""
    try:
        return WORK_METRICS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown work kind {kind!r}") from None


def work_values(src: RunSource, kind: str, first: int, last: int) -> pd.DataFrame:
    """rank, host, dp, pp, tp, cp, value (the rank's work per step over the median rank's),
    amount (its work per step): one row per rank, NaN where it has none of that kind."""
    m = work_metric(kind)
    got = src.query(m.sql or "", kind=kind, first=first, last=last)[["rank", "amount", "value"]]
    return src.topology().merge(got, on="rank", how="left")


def colour_values(
    src: RunSource, key: str, work: str | None, first: int, last: int
) -> tuple[pd.DataFrame, Metric]:
    """What the 3D view is coloured by: the work ratio of ``work`` when one is chosen, else
    the time metric ``key``; with the metric that says how to label it."""
    if work in (None, "", TIME):
        return rank_values(src, key, first, last), metric(key)
    return work_values(src, str(work), first, last), work_metric(str(work))


def fold_cp(values: pd.DataFrame, cp: int | None) -> pd.DataFrame:
    """One cell per (dp, pp, tp): the mean over context-parallel ranks (``cp`` None), or the
    ranks of one cp index. A folded cell keeps its first rank and host for hover and clicks,
    and ``ranks`` counts the ranks it stands for."""
    if cp is not None:
        out = values[values["cp"] == cp].copy()
        out["ranks"] = 1
        return out.reset_index(drop=True)
    if values["cp"].nunique() <= 1:
        out = values.copy()
        out["ranks"] = 1
        return out.reset_index(drop=True)
    values = values.sort_values("rank")
    out = values.groupby(["dp", "pp", "tp"], as_index=False).agg(
        rank=("rank", "first"),
        host=("host", "first"),
        value=("value", "mean"),
        ranks=("rank", "size"),
    )
    out["cp"] = -1
    return out


def rank_step_grid(
    src: RunSource, first: int, last: int, rank_bins: int = 256, step_bins: int = 200
) -> pd.DataFrame:
    """The rank x step heatmap's cells on a grid of at most rank_bins x step_bins."""
    ranks = len(src.topology())
    return src.query(
        "rank_step_grid",
        first=first,
        last=last,
        rank_bins=max(1, min(rank_bins, ranks)),
        step_bins=max(1, min(step_bins, last - first + 1)),
    )


def heatmap_measure(key: str) -> Metric:
    """The heatmap measure of a key sent by the browser; ValueError for anything else."""
    try:
        return HEATMAP_MEASURES[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown heatmap measure {key!r}") from None


def with_blame(grid: pd.DataFrame, report: dict) -> pd.DataFrame:
    """``grid`` with a ``blame`` column: per row of ranks, the largest share of step time
    (%) the analyzer's findings blame on one of its ranks, the same in every step."""
    blame = blame_by_rank(report)
    out = grid.copy()
    out["blame"] = [
        100.0 * max((v for r, v in blame.items() if lo <= r <= hi), default=0.0)
        for lo, hi in zip(out["rank_lo"], out["rank_hi"], strict=True)
    ]
    return out


def timeline_rows(
    src: RunSource, ranks: Sequence[int], step: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(spans, collectives) of a few ranks in one step."""
    ranks = [int(r) for r in ranks][:64]
    return (
        src.query_ranks("timeline_spans", ranks, step=int(step)),
        src.query_ranks("timeline_collectives", ranks, step=int(step)),
    )


def neighbourhood(src: RunSource, rank: int, limit: int = 32) -> list[int]:
    """The ranks a rank waits for and that wait for it: its pipeline group (same dp, tp, cp;
    every stage) and its tensor-parallel peers (same dp, pp, cp), in rank order."""
    topo = src.topology()
    row = topo[topo["rank"] == rank]
    if row.empty:
        return []
    c = row.iloc[0]
    same_cp = topo["cp"] == c["cp"]
    pipeline = same_cp & (topo["dp"] == c["dp"]) & (topo["tp"] == c["tp"])
    tensor = same_cp & (topo["dp"] == c["dp"]) & (topo["pp"] == c["pp"])
    ranks = sorted(int(r) for r in topo[pipeline | tensor]["rank"])
    if len(ranks) > limit:  # keep the rank itself, then the nearest others
        ranks = sorted(sorted(ranks, key=lambda r: abs(r - rank))[:limit])
    return ranks


def links(src: RunSource, first: int, last: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(pipeline pairs, process groups) with their bandwidths over the step range."""
    p2p = src.query("links_p2p", first=first, last=last)
    groups = src.query("links_groups", first=first, last=last)
    return p2p, groups


def gpu_by_rank(src: RunSource, first: int, last: int) -> pd.DataFrame:
    """Per-rank mean NVML readings (empty on a CPU run)."""
    return src.topology().merge(src.query("metric_gpu", first=first, last=last), on="rank")


def whatif(src: RunSource, first: int, last: int) -> dict:
    """The what-if over the chosen steps (``grid``, ``steps``, ``summary``, or ``error``: one
    line); over the whole run it reads every step, as ``megascope whatif`` does."""
    whole = (first, last) == step_bounds(src)
    return src.whatif(None if whole else (first, last))
