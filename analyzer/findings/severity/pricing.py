"""Severity for a report: each priced finding's what-if saving with the findings above it fixed
(:mod:`analyzer.findings.severity.ordered`), the candidates under :data:`~analyzer.findings.severity.cost.NOISE`
dismissed, and the spread ``load_imbalance`` where the named findings leave compute unexplained.
What a cause costs and how it is fixed in the replay is :mod:`analyzer.findings.severity.cost`."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pandas as pd

from analyzer.findings.common import Context, finding, stage_excess
from analyzer.findings.severity import ordered
from analyzer.findings.severity.cost import (
    IMBALANCE_MIN,
    SHARE,
    WORKER_SHARE,
    Costs,
    is_work_imbalance,
    open_costs,
)

log = logging.getLogger(__name__)

# a straggler whose operations hold less than this share of its own excess is priced from its
# step time and arrivals, not by the replay (:func:`_replay_holds`)
HELD_SHARE = 0.5


def price(
    ctx: Context, findings: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Findings with what-if severities, the dismissed candidates, and how severity was had."""
    costs, why = open_costs(ctx.run, ctx.lo, ctx.hi)
    if costs is None:
        log.info("severity stays the detectors' estimate: %s", why)
        return findings, [], {"method": "estimate", "why": why}
    masks = {id(f): _mask(costs, f) for f in findings}
    priced = [(f, m) for f in findings if (m := masks[id(f)]) is not None]
    kept = [f for f in findings if masks[id(f)] is None]
    # each is priced with the findings above it fixed first (analyzer.findings.severity.ordered)

    cands = ordered.candidates(ctx, costs, priced, findings)
    order, dropped = ordered.price_in_order(costs, cands)
    kept += [cands[i].f for i in order]
    dismissed = [cands[i].f for i in dropped]
    named = np.zeros(len(costs.rank), bool)
    for f in kept:
        if masks[id(f)] is not None:
            named |= masks[id(f)]
    by_work = any(is_work_imbalance(f) for f in kept)
    extra = None if by_work else _load_imbalance(ctx, costs, named)
    if extra is not None:
        kept = [f for f in kept if f["kind"] != "transient_stall"] + [extra]
    steps = costs.w.steps
    info = {"method": "whatif", "slowdown": round(costs.t / costs.t_ideal, 4),
            "steps": [int(steps.min()), int(steps.max())]}  # fmt: skip
    return kept, dismissed, info


def _mask(costs: Costs, f: dict[str, Any]) -> np.ndarray | None:
    kind, ev = f["kind"], f["evidence"]
    if kind == "straggler" and ev.get("signal") == "late_arrival":
        return None  # its peers wait inside their backward, which no replay places: its estimate
    if kind == "straggler" and ev.get("signal") == "cpu_time":
        return None  # it takes its peers' cores, which no replay of their times shows: estimate
    if kind == "straggler":
        mask = costs.ranks_compute(f["ranks"])
        return mask if _replay_holds(costs, f, mask) else None
    if kind == "hardware_imbalance" or is_work_imbalance(f):
        return costs.ranks_compute(f["ranks"])
    if kind == "stage_imbalance":
        return costs.stage_compute(int(ev["stage"]))
    if kind == "slow_link":
        groups = {ev.get("group")} | {a.get("group") for a in ev.get("also", [])}
        return costs.link(list(ev.get("members") or f["ranks"]), {g for g in groups if g})
    return None


def _replay_holds(costs: Costs, f: dict[str, Any], mask: np.ndarray) -> bool:
    """Whether the replay holds most of a straggler's own excess (its evidence's
    ``excess_ms_per_step``: its step time over its peers', less its waits for them and its data
    loading), so that the replay can price it.

    The replay is the spans and collectives; the time between them is in no operation. Where
    the spans cover a small part of the step (torchtitan's backward spans hold under a tenth
    of its backward) and the rank's excess lies outside them (a rank that sleeps, or waits on a
    slow device, between its spans), fixing its operations saves nothing there while a run
    without it is that much faster. Where its peers waited for it about as long as its own
    excess (its arrival blame within a factor 1 / :data:`HELD_SHARE` of it either way: its
    arrivals and its own time agree) and the replay holds under
    :data:`HELD_SHARE` of it, the straggler keeps
    the detector's pricing: its own excess per step, capped by what its peers waited for it
    (its arrival blame), over the median step; its evidence says so (``priced_by``,
    ``replay_excess_ms_per_step``)."""
    ev = f["evidence"]
    excess_ms = float(ev.get("excess_ms_per_step") or 0.0)
    if not excess_ms > 0:
        return True
    blame_ms = float(ev.get("arrival_blame_ms_per_step") or 0.0)
    # beyond its peers' chance share of being last (ranks sharing cores), where known
    blame_ms = float(ev.get("arrival_blame_beyond_peers_ms_per_step", blame_ms) or 0.0)
    if not HELD_SHARE * excess_ms <= blame_ms <= excess_ms / HELD_SHARE:
        # its peers did not wait for most of it, or waited far longer than its own excess (a
        # rank downstream of a straggler arrives late by the straggler's time, not its own):
        # the replay says what it costs
        return True
    seen_ms = costs.seen_excess(mask) * 1e3
    if seen_ms >= HELD_SHARE * excess_ms:
        return True
    ev["priced_by"] = "own_time"
    ev["replay_excess_ms_per_step"] = round(seen_ms, 3)
    return False


def _load_imbalance(ctx: Context, costs: Costs, named: np.ndarray) -> dict[str, Any] | None:
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
