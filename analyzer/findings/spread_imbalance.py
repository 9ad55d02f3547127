"""The spread ``load_imbalance``: compute imbalance spread over ranks and steps that the named
findings leave unexplained, read from the what-if replay once the findings are priced.

No detector reads it from the rows: it is what is left of the replay's saving with every
rank's compute at its peers' median once the findings kept are fixed (``named``), where no
rank, nor the last stage, explains half of it, where it is uneven per data-parallel replica
(not per rank: the noise of the hosts), and, on a CPU run, where the ranks' CPU time is uneven
too (:func:`cpu_spread`). The pricing calls :func:`spread` (given to it by ``analyze``); the
kind is declared with the straggler detector's (:data:`analyzer.findings.work_imbalance.LOAD_IMBALANCE`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analyzer.findings.common import Context, finding, stage_excess
from analyzer.findings.record import Finding
from analyzer.findings.severity.cost import IMBALANCE_MIN, SHARE, WORKER_SHARE, Costs


def spread(ctx: Context, costs: Costs, named: np.ndarray) -> Finding | None:
    """One finding for compute imbalance spread over ranks and steps (see the module doc);
    ``named``: the operations of the findings kept, fixed first."""
    w = costs.w
    t_meas = w.replayer.run(costs.fixed(named)) if named.any() else w.replay()
    t_named = float(np.mean(t_meas))
    t_fix = w.replayer.run(costs.fixed(costs.compute | named, among=~named))
    t_all = float(np.mean(t_fix))
    residual = (t_named - t_all) / costs.t
    if residual < IMBALANCE_MIN or t_named - t_all <= 0:
        return None
    gap = t_named - t_all  # what the spread imbalance costs, with the named causes fixed
    ranks = np.unique(costs.rank)
    own = {int(r): _gain(costs, named | costs.ranks_compute([int(r)]), t_named)
           for r in _most_excess(costs, ranks)}  # fmt: skip
    top = sorted(own, key=lambda r: -own[r])[: max(1, math.ceil(len(ranks) * WORKER_SHARE))]
    m_w = _gain(costs, named | costs.ranks_compute(top), t_named) / gap
    stages = np.unique(w.coords["pp"])
    last = costs.stage_compute(int(stages.max())) if len(stages) > 1 else None
    m_s = _gain(costs, named | last, t_named) / gap if last is not None else 0.0
    if m_w >= SHARE or m_s >= SHARE:
        return None
    share, size = _replica_share(costs)
    if share is None or share < (1 + 1 / size) / 2:
        return None  # uneven per rank, not per data-parallel replica: noise of the hosts
    cpu = cpu_spread(ctx)
    if cpu is not None and cpu < IMBALANCE_MIN:
        return None  # even in CPU time: the cores' scheduling spread the time, not the work
    per_step = 1.0 - t_fix / np.where(t_meas > 0, t_meas, 1)
    worst = np.argsort(-per_step)[:5]
    lead = sorted(own, key=lambda r: -own[r])[:5]
    ev = {
        "share": round(residual, 4),
        "m_w": round(m_w, 4),
        "m_s": round(m_s, 4),
        "ranks_most_affected": lead,
        "rank_savings": {str(r): round(own[r] / costs.t, 4) for r in lead},
        "steps_most_affected": [int(w.steps[i]) for i in worst],
        "step_savings": {str(int(w.steps[i])): round(float(per_step[i]), 4) for i in worst},
        "steps_compared": len(w.steps),
        "replica_share": round(share, 4),
    }
    msg = (
        f"work imbalance spread over ranks and steps costs {residual:.1%} of the step: with "
        f"every rank's compute at its peers' median in each step the run would be that much "
        f"faster, and no rank (top {len(top)}: {m_w:.0%}) nor the last stage ({m_s:.0%}) "
        f"explains half of it; most affected: ranks {', '.join(map(str, lead))}"
    )
    sev = min(residual, costs.total)
    return finding(ctx, "load_imbalance", sorted(int(r) for r in ranks), sev, msg, ev)


def cpu_spread(ctx: Context) -> float | None:
    """What the spread of the ranks' CPU time costs, a share of the step; None where the run
    counted none (``Context.rank_cpu``: a CPU device).

    Per step, the largest excess of a rank's CPU time in the step over the median of its
    pipeline stage's other ranks (what they would wait for it, had every rank its own core),
    over the step's median time; the mean over the steps. Where ranks share cores, the
    scheduler lengthens one rank's compute now and another's next (4 gloo ranks on 2 cores:
    8-12% of a step, spread over every rank), which a replica's one unit of compute a step
    (plain DDP) cannot tell from work given unevenly; work given unevenly also lengthens the
    CPU time, scheduling does not (healthy runs: 2-3%; one rank at 1.5x: 15-17%).
    """
    cpu = ctx.rank_cpu
    if cpu.empty:
        return None
    excess = stage_excess(cpu, "cpu_ns").clip(lower=0).groupby(cpu.step).max()
    step = ctx.rank_steps.groupby("step").step_ns.median().astype(float)
    share = (excess / step.reindex(excess.index)).replace([np.inf, -np.inf], np.nan).dropna()
    return float(share.mean()) if len(share) else None


def _replica_share(costs: Costs) -> tuple[float | None, int]:
    """How much of the compute's variation the (dp replica, step) means explain, and how many
    units a replica has in a step.

    A unit is one kind of compute (``forward``, ``backward``; every kind when the run has no
    such names) on one rank in one step; its value, the log of its time over the median of the
    same kind on the ranks of its stage. Work imbalance across data-parallel ranks (uneven
    sequence lengths) lengthens every unit of a replica in that step alike: the share is near
    1. A host's noise hits units one by one: the share is near 1 / units. Needs over half of
    the way from one to the other.
    """
    w = costs.w
    comp = costs.compute
    labels = costs.label[comp]
    lower = np.char.lower(labels.astype(str))
    passes = (np.char.find(lower, "forward") >= 0) | (np.char.find(lower, "backward") >= 0)
    pick = passes if passes.any() else np.ones(len(labels), bool)
    idx = np.flatnonzero(comp)[pick]
    if not len(idx):
        return None, 1
    frame = pd.DataFrame(w.measured[idx], columns=range(w.measured.shape[1]))
    frame["rank"], frame["label"] = costs.rank[idx], costs.label[idx]
    frame["dp"], frame["pp"] = w.coords["dp"][idx], w.coords["pp"][idx]
    long = frame.groupby(["rank", "label", "dp", "pp"]).sum().stack().rename("t").reset_index()
    long = long.rename(columns={long.columns[4]: "step"})
    long = long[long.t > 0]
    ref = long.groupby(["step", "pp", "label"]).t.transform("median")
    x = np.log(long.t / ref)
    keys = [long.dp, long.step]
    mean = x.groupby(keys).transform("mean")
    size = int(x.groupby(keys).transform("size").median()) if len(x) else 1
    total = float(((x - x.mean()) ** 2).sum())
    if total <= 0:
        return None, max(size, 1)
    return float(((mean - x.mean()) ** 2).sum()) / total, max(size, 1)


def _most_excess(costs: Costs, ranks: np.ndarray, limit: int = 64) -> np.ndarray:
    """The ``limit`` ranks whose compute runs most over their peers' median (all when few)."""
    if len(ranks) <= limit:
        return ranks
    every = np.ones(len(costs.rank), bool)
    over = np.maximum(costs.w.measured - costs.fixed(costs.compute, among=every), 0).sum(axis=1)
    per = np.bincount(np.searchsorted(ranks, costs.rank), weights=over, minlength=len(ranks))
    return ranks[np.argsort(-per, kind="stable")[:limit]]


def _gain(costs: Costs, mask: np.ndarray, t_base: float) -> float:
    return t_base - float(np.mean(costs.w.replayer.run(costs.fixed(mask))))
