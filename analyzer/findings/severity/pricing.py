"""Severity for a report: each priced finding's what-if saving with the findings above it fixed
(:mod:`analyzer.findings.severity.ordered`), the candidates under :data:`~analyzer.findings.severity.cost.NOISE`
dismissed, and the spread ``load_imbalance`` (:mod:`analyzer.findings.spread_imbalance`) where the
named findings leave compute unexplained. What a cause costs is
:mod:`analyzer.findings.severity.cost`; what fixing each kind changes in the replay, its
detector's declaration (:mod:`analyzer.findings.detector`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from analyzer.findings.common import Context
from analyzer.findings.record import Finding
from analyzer.findings.severity import ordered
from analyzer.findings.severity.cost import Costs, is_work_imbalance, open_costs

log = logging.getLogger(__name__)

# what fixing a finding changes in the replay (the registry's, by kind): its mask, or None
FixOf = Callable[[Costs, Finding], "np.ndarray | None"]
# the spread load imbalance the named findings leave (analyzer.findings.spread_imbalance)
Spread = Callable[[Context, Costs, np.ndarray], "Finding | None"]


def price(
    ctx: Context, findings: list[Finding], fix_of: FixOf, spread: Spread
) -> tuple[list[Finding], list[Finding], dict[str, Any]]:
    """Findings with what-if severities, the dismissed candidates, and how severity was had.

    ``fix_of``: what fixing a finding changes in the replay (None: not priced, its estimate
    stays); ``spread``: the spread load imbalance the kept findings leave, if any. Both come
    from the detectors (:mod:`analyzer.findings.registry`); pricing names no kind of finding
    but the transient stalls a spread imbalance replaces."""
    costs, why = open_costs(ctx.run, ctx.lo, ctx.hi)
    if costs is None:
        log.info("severity stays the detectors' estimate: %s", why)
        return findings, [], {"method": "estimate", "why": why}
    masks = {id(f): fix_of(costs, f) for f in findings}
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
    extra = None if by_work else spread(ctx, costs, named)
    if extra is not None:
        kept = [f for f in kept if f["kind"] != "transient_stall"] + [extra]
    steps = costs.w.steps
    info = {"method": "whatif", "slowdown": round(costs.t / costs.t_ideal, 4),
            "steps": [int(steps.min()), int(steps.max())]}  # fmt: skip
    return kept, dismissed, info
