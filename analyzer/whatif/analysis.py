"""The what-if analysis of a run: how much faster it would be without its stragglers.

As in ByteDance Seed's study (OSDI 2025): replay the run's steps on their dependency graph with
the measured durations (``t_measured``; launch gaps left out, as the graph has none) and with
every operation's duration set to its typical value (``t_ideal``) over its peers: the same
operation (same span name and piece, or same collective, group and size) on every rank. By
default (``study``) the typical value is the study's: the mean duration of a compute operation
and the median transfer time of a collective over the peers in all steps analyzed; ``median``
takes the median over the peers in the same step (see :func:`typical_durations`). Then

* ``slowdown`` S = mean step time measured / ideal; ``by_step``: the same per step;
* ``by_rank`` / ``by_dp_rank`` / ``by_stage`` / ``by_op``: S of the ideal replay in which only
  that rank's (dp rank's, stage's, op kind's) operations keep their measured durations;
* ``m_s`` (stage partitioning): (t_measured - t_rem) / (t_measured - t_ideal), ``t_rem`` the
  measured replay with the last stage's operations set to typical: the share of the slowdown
  that the last stage explains; ``m_w`` (individual workers): the same for the 3% of ranks
  with the highest S by rank.

On big runs the per-group replays are bounded: at most ``max_groups`` dp ranks (and ranks) are
replayed, the ones whose operations exceed their typical durations the most; the others are
left out of ``by_dp_rank`` / ``by_rank`` (their S is at most the smallest one shown), and
``by_rank`` beyond ``exact_ranks`` ranks is the study's estimate min(S of its dp rank, S of its
stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analyzer.db import Run
from analyzer.whatif.graph import Graph, build_graph
from analyzer.whatif.load import RunTimes, WhatIfError, read_times
from analyzer.whatif.replay import Replayer
from tracer.rundir import coords_of

SCHEMA = "megascope.whatif/1"
WORKER_SHARE = 0.03  # M_W: the top 3% of workers (the study's choice)
TYPICAL = ("study", "median")


@dataclass
class WhatIf:
    """A run ready to be replayed: graph, measured and typical durations (slots x steps)."""

    times: RunTimes
    graph: Graph
    replayer: Replayer
    measured: np.ndarray  # float32 (slots, steps)
    typical: np.ndarray
    coords: dict[str, np.ndarray]  # axis -> per slot coordinate

    @property
    def steps(self) -> np.ndarray:
        """The steps replayed, one per column of the durations."""
        return self.times.steps

    def replay(
        self, keep: np.ndarray | None = None, typical: np.ndarray | None = None
    ) -> np.ndarray:
        """Step times with the ``keep`` slots at measured durations and the others typical
        (``keep`` None: all measured); ``typical`` (a mask) sets slots to typical instead."""
        if keep is None:
            if typical is None:
                return self.replayer.run(self.measured)
            keep = ~typical
        return self.replayer.run(np.where(keep[:, None], self.measured, self.typical))

    def ideal(self) -> np.ndarray:
        """Step times with every slot at its typical duration."""
        return self.replayer.run(self.typical)


def prepare(
    source: Run | str, steps: tuple[int, int] | None = None, typical: str = "study"
) -> WhatIf:
    """Read a run (opened, or its path), build its graph and its measured and ``typical``
    durations."""
    times = read_times(source, steps)
    graph = build_graph(times.template, times.meta)
    measured = _measured(graph, times)
    durations = typical_durations(graph.slots.key, graph.group >= 0, measured, typical)
    return WhatIf(times, graph, Replayer(graph), measured, durations, _coords(graph, times.meta))


def _measured(graph: Graph, times: RunTimes) -> np.ndarray:
    """Compute durations, and transfer times of collective members (end - last arrival)."""
    start, end = graph.slots.times(times.t0, times.t1)
    d = end - start
    m = graph.members
    if len(m):
        last = np.maximum.reduceat(start[m], graph.member_start[:-1], axis=0)
        sizes = np.diff(graph.member_start)
        d[m] = end[m] - np.repeat(last, sizes, axis=0)
    np.maximum(d, 0, out=d)
    return d.astype(np.float32, copy=False)


def typical_durations(
    key: np.ndarray, comm: np.ndarray, measured: np.ndarray, how: str
) -> np.ndarray:
    """Each slot's typical duration in each step, over the slots of its key (its peers):

    * ``study``: as the study does, over the peers in every step analyzed: the mean duration of
      a compute operation, the median transfer time of a collective;
    * ``median``: the median over the peers in the same step (a step-wide slowdown, all ranks
      alike, is then no straggler's).
    """
    if how not in TYPICAL:
        raise WhatIfError(f"typical must be one of {', '.join(TYPICAL)}, got {how!r}")
    out = np.empty_like(measured)
    order = np.argsort(key, kind="stable")
    bounds = np.flatnonzero(np.r_[True, key[order][1:] != key[order][:-1], True])
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        idx = order[lo:hi]
        block = measured[idx]
        if how == "median":
            out[idx] = np.median(block, axis=0)
        elif comm[idx[0]]:
            out[idx] = np.median(block)
        else:
            out[idx] = block.mean(dtype=np.float64)
    return out


def _coords(graph: Graph, meta: dict) -> dict[str, np.ndarray]:
    ranks = graph.slots.rank
    uniq, inv = np.unique(ranks, return_inverse=True)
    table = meta.get("coords")
    mesh = meta.get("mesh") or {}
    out = {k: np.zeros(len(uniq), dtype=np.int64) for k in ("dp", "pp", "tp", "cp")}
    for i, r in enumerate(uniq):
        if isinstance(table, list) and r < len(table) and table[r]:
            c = dict(zip(("dp", "pp", "tp", "cp"), table[r], strict=False))
        else:
            c = coords_of(int(r), mesh)
        for k in out:
            out[k][i] = int(c.get(k, 0))
    out = {k: v[inv] for k, v in out.items()}
    out["rank"] = ranks
    return out


def mean_ratio(t: np.ndarray, ideal: np.ndarray) -> float:
    """Mean step time ``t`` over the ``ideal``'s (NaN without an ideal)."""
    return float(np.mean(t) / np.mean(ideal)) if np.mean(ideal) > 0 else float("nan")


def _share(t_ori: np.ndarray, t_rem: np.ndarray, t_ideal: np.ndarray) -> float | None:
    gap = float(np.mean(t_ori) - np.mean(t_ideal))
    if gap <= 1e-9 * max(float(np.mean(t_ori)), 1e-30):
        return None
    return float((np.mean(t_ori) - np.mean(t_rem)) / gap)


def excess_by(w: WhatIf, axis: str) -> dict[int, float]:
    """How much each value of ``axis`` runs over its typical durations (to pick replays)."""
    over = np.maximum(w.measured - w.typical, 0).sum(axis=1)
    vals = w.coords[axis]
    sums = np.bincount(vals, weights=over)
    return {int(v): float(sums[v]) for v in np.unique(vals)}


def _by(w: WhatIf, axis: str, ideal: np.ndarray, limit: int | None = None) -> dict[int, float]:
    vals = np.unique(w.coords[axis])
    if limit is not None and len(vals) > limit:
        ex = excess_by(w, axis)
        vals = np.array(sorted(vals, key=lambda v: -ex[int(v)])[:limit])
    out = {int(v): mean_ratio(w.replay(keep=w.coords[axis] == v), ideal) for v in vals}
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def analyze_whatif(
    run_dir: str,
    steps: tuple[int, int] | None = None,
    max_groups: int = 16,
    exact_ranks: int = 64,
    typical: str = "study",
) -> dict:
    """The what-if report of ``run_dir`` as a dict (``megascope whatif --json``)."""
    w = prepare(run_dir, steps, typical)
    t_ori, t_ideal = w.replay(), w.ideal()
    if not len(t_ori):
        raise WhatIfError("no step to replay")
    by_step = {
        int(s): float(a / b) if b > 0 else None
        for s, a, b in zip(w.steps, t_ori, t_ideal, strict=True)
    }
    stages = np.unique(w.coords["pp"])
    by_stage = _by(w, "pp", t_ideal)
    dp_limit = None if len(np.unique(w.coords["dp"])) <= 2 * max_groups else max_groups
    by_dp = _by(w, "dp", t_ideal, dp_limit)
    by_op = {
        name: mean_ratio(w.replay(keep=w.graph.slots.op == i), t_ideal)
        for i, name in enumerate(w.graph.slots.ops)
    }
    by_op = dict(sorted(by_op.items(), key=lambda kv: -kv[1]))
    ranks = np.unique(w.coords["rank"])
    if len(ranks) <= exact_ranks:
        by_rank = _by(w, "rank", t_ideal)
        rank_method = "replay"
    else:
        by_rank = _rank_estimate(w, ranks, by_dp, by_stage)
        rank_method = "min(dp rank, stage)"
    last = w.coords["pp"] == stages.max()
    m_s = _share(t_ori, w.replay(typical=last), t_ideal)
    n_w = max(1, math.ceil(len(ranks) * WORKER_SHARE))
    top = [r for r, _ in sorted(by_rank.items(), key=lambda kv: (-kv[1], kv[0]))[:n_w]]
    m_w = _share(t_ori, w.replay(typical=np.isin(w.coords["rank"], top)), t_ideal)
    return {
        "schema": SCHEMA,
        "run": {
            "world_size": w.times.meta.get("world_size"),
            "mesh": w.times.meta.get("mesh"),
            "ranks": len(ranks),
            "steps": [int(s) for s in w.steps],
            "steps_left_out": w.times.left_out,
            "template_step": w.times.template_step,
            "operations_per_step": len(w.graph.slots),
        },
        "typical": typical,
        "slowdown": mean_ratio(t_ori, t_ideal),
        "saving": 1.0 - 1.0 / mean_ratio(t_ori, t_ideal) if np.mean(t_ori) > 0 else None,
        "t_measured_s": float(np.mean(t_ori)),
        "t_ideal_s": float(np.mean(t_ideal)),
        "by_rank": {str(k): v for k, v in by_rank.items()},
        "by_rank_method": rank_method,
        "by_dp_rank": {str(k): v for k, v in by_dp.items()},
        "by_stage": {str(k): v for k, v in by_stage.items()},
        "by_op": by_op,
        "by_step": {str(k): v for k, v in by_step.items()},
        "m_w": m_w,
        "m_w_ranks": [int(r) for r in top],
        "m_s": m_s,
    }


def _rank_estimate(w: WhatIf, ranks, by_dp: dict, by_stage: dict) -> dict[int, float]:
    """The study's per-worker score: min(S of its dp rank, S of its stage); dp ranks not
    replayed count as 1."""
    first: dict[int, tuple[int, int]] = {}
    for r, dp, pp in zip(w.coords["rank"], w.coords["dp"], w.coords["pp"], strict=True):
        first.setdefault(int(r), (int(dp), int(pp)))
    out = {
        int(r): min(by_dp.get(first[int(r)][0], 1.0), by_stage.get(first[int(r)][1], 1.0))
        for r in ranks
    }
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))
