"""Tables of the what-if for a picture: the per-worker grid and the per-step slowdown.

from analyzer.whatif import prepare
from analyzer.whatif.views import per_step, worker_grid
w = prepare("RUN")
grid = worker_grid(w)   # dp, pp, ranks, first_rank, excess_s, replayed, slowdown
steps = per_step(w)     # step, measured_s, ideal_s, slowdown

``worker_grid`` is the per-worker view of ByteDance Seed's straggler study (OSDI 2025, its
figure 14): a *worker* is one (dp rank, pipeline stage) cell, the tensor- and context-parallel
ranks of that cell together, and its slowdown is S of the ideal replay in which only that
cell's operations keep their measured durations: mean(replay(keep=cell)) / mean(ideal()).
A cell near 1.0 costs nothing; the straggling worker's cell is the highest.

One replay per cell costs one replay of every step (about 1.5 s at 12,288 ranks and 50 steps),
so the grid is bounded: at most ``max_cells`` (64) cells are replayed, and fewer on a big run,
as many as ``max_work`` operation-steps allow (operations per step x steps per replay; at least
``MIN_CELLS``: 8 at 12,288 ranks x 50 steps). Past that bound only the cells whose
operations run the most over their typical durations are replayed (``excess_s``: the sum over
the cell's operations and steps of measured minus typical where positive, as
:func:`analyzer.whatif.analysis.excess_by` picks the dp ranks that ``megascope whatif`` replays);
the others keep ``replayed`` False and a NaN slowdown, and are drawn blank: with less excess
than every cell shown, they are unlikely to be the straggling workers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from analyzer.whatif.analysis import WhatIf, excess_by, mean_ratio

MAX_CELLS = 64  # worker cells replayed at most (one replay of every step each)
MIN_CELLS = 8  # ... and at least, however big the run
MAX_WORK = 2e8  # operation-steps replayed for the grid (~3 s of one core), past MIN_CELLS

GRID_COLUMNS = ["dp", "pp", "ranks", "first_rank", "excess_s", "replayed", "slowdown"]


def _cells(w: WhatIf) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cell id per slot, dp per cell, pp per cell): the (dp, pp) pairs present, in order."""
    dp, pp = w.coords["dp"], w.coords["pp"]
    width = int(pp.max()) + 1 if len(pp) else 1
    code = dp.astype(np.int64) * width + pp
    uniq, cell = np.unique(code, return_inverse=True)
    return cell.astype(np.int64), uniq // width, uniq % width


def cell_budget(w: WhatIf, max_cells: int = MAX_CELLS, max_work: float = MAX_WORK) -> int:
    """How many cells :func:`worker_grid` replays at most on this run."""
    work = max(len(w.graph.slots) * len(w.steps), 1)
    return int(min(max_cells, max(MIN_CELLS, max_work // work)))


def worker_grid(
    w: WhatIf,
    max_cells: int = MAX_CELLS,
    ideal: np.ndarray | None = None,
    max_work: float = MAX_WORK,
) -> pd.DataFrame:
    """One row per (dp, pp) cell with operations, sorted by dp then pp (see module doc):
    ``ranks`` (ranks in the cell), ``first_rank``, ``excess_s``, ``replayed`` and
    ``slowdown`` (NaN where not replayed). ``ideal``: ``w.ideal()`` when already known."""
    cell, dps, pps = _cells(w)
    if not len(cell):
        return pd.DataFrame({c: [] for c in GRID_COLUMNS})
    n = len(dps)
    ranks = w.coords["rank"]
    first = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(first, cell, ranks)
    n_ranks = pd.Series(ranks).groupby(cell).nunique().to_numpy()
    # excess_by sums per value of one coordinate: give it the cell as a coordinate of its own
    ex = excess_by(dataclasses.replace(w, coords={**w.coords, "cell": cell}), "cell")
    excess = np.array([ex.get(c, 0.0) for c in range(n)])
    budget = min(max_cells, cell_budget(w, max_cells, max_work))
    if n > budget:
        chosen = np.sort(np.argsort(-excess, kind="stable")[: max(budget, 0)])
    else:
        chosen = np.arange(n)
    ideal = w.ideal() if ideal is None else ideal
    slowdown = np.full(n, np.nan)
    for c in chosen:
        slowdown[c] = mean_ratio(w.replay(keep=cell == c), ideal)
    replayed = np.zeros(n, dtype=bool)
    replayed[chosen] = True
    return pd.DataFrame({
        "dp": dps.astype(np.int64), "pp": pps.astype(np.int64), "ranks": n_ranks.astype(np.int64),
        "first_rank": first.astype(np.int64), "excess_s": excess, "replayed": replayed,
        "slowdown": slowdown,
    })  # fmt: skip


def per_step(
    w: WhatIf, measured: np.ndarray | None = None, ideal: np.ndarray | None = None
) -> pd.DataFrame:
    """One row per step replayed: the measured replay's and the ideal replay's step time (s)
    and their ratio (NaN where the ideal step takes no time)."""
    t = w.replay() if measured is None else measured
    i = w.ideal() if ideal is None else ideal
    t = np.asarray(t, dtype=np.float64)
    i = np.asarray(i, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(i > 0, t / np.where(i > 0, i, 1.0), np.nan)
    return pd.DataFrame(
        {"step": np.asarray(w.steps, dtype=np.int64), "measured_s": t, "ideal_s": i,
         "slowdown": ratio}
    )  # fmt: skip


def summary(w: WhatIf, steps: pd.DataFrame, grid: pd.DataFrame) -> dict:
    """The numbers of the panel's one-line summary (JSON-able)."""
    t, i = steps["measured_s"].to_numpy(), steps["ideal_s"].to_numpy()
    s = mean_ratio(t, i) if len(t) else float("nan")
    return {
        "slowdown": s,
        "saving": 1.0 - 1.0 / s if s and np.isfinite(s) and s > 0 else None,
        "t_measured_s": float(np.mean(t)) if len(t) else None,
        "t_ideal_s": float(np.mean(i)) if len(i) else None,
        "steps": len(steps),
        "steps_left_out": list(w.times.left_out),
        "cells": len(grid),
        "cells_replayed": int(grid["replayed"].sum()) if len(grid) else 0,
    }
