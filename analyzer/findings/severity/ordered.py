"""Severity in order: each finding priced with the findings above it already fixed.

A candidate's saving alone (:mod:`analyzer.findings.severity.cost`) counts what other causes cost
through it: a link that carries a straggler's late traffic, the last stage of a pipeline whose
straggler every step waits for, seem to save time alone, and nothing once the straggler is
fixed. So the findings are priced as a conditional, sequential what-if (greedy): the candidate
whose fix saves most is fixed in the replay, every remaining candidate is priced again on top of
it, the next largest is fixed in turn, and so on. A finding's severity is
``1 - T(above and it fixed) / T(above fixed)``: what fixing it saves once the findings above it
are fixed (its saving alone for the first). The rounds stop when no remaining candidate saves
:data:`~analyzer.findings.severity.cost.NOISE` of the step; those are dismissed, whatever the detector's
own estimate, with the saving of that last round as their severity.

Fixing a candidate sets its operations as :meth:`Costs.saving` would (a straggler or a slow link
at its peers' durations with its own noise kept, a hot expert's work spread evenly, a stage's
compute scaled from the others), and the replay keeps them so for the rounds after. A data
stall is not priced (its severity stays the detector's) but takes its place in the order: once
the rounds reach its severity, its ranks' data loading is fixed for the candidates priced after
(a straggler that every rank's wait for the stall hides saves nothing before). A cause that
holds another (a stage that holds a straggler) is priced beyond it, with the one it holds fixed
in its base whatever the order, and is not fixed before it: fixing the stage first would leave
the straggler nothing to save.

Cost: one replay per remaining candidate per round, rounds = findings kept + 1 (the first is the
alone pricing), on the steps :func:`~analyzer.findings.severity.cost.open_costs` keeps (the last ones of
the window, up to ``MAX_CELLS`` operation-steps on large runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from analyzer.findings.common import Context
from analyzer.findings.record import Finding
from analyzer.findings.severity.cost import NOISE, Costs, redistributed, uncapped


@dataclass
class Candidate:
    """One cause in the order: a priced finding, or a data stall (``stall``: its detector's
    severity decides its place; it is fixed, never priced)."""

    f: Finding
    mask: np.ndarray  # its operations
    rows: np.ndarray  # the slots its fix changes
    values: np.ndarray  # ...and their durations then (rows x steps)
    cap: bool = True  # at most the whole ideal's saving
    held: list[int] = field(default_factory=list)  # candidates (indices) whose ops it holds
    stall: float | None = None
    alone: float = 0.0
    last: float = 0.0


def candidates(
    ctx: Context,
    costs: Costs,
    priced: list[tuple[Finding, np.ndarray]],
    findings: list[Finding],
) -> list[Candidate]:
    """The priced findings (with their masks) and the data stalls of at least :data:`NOISE`,
    as candidates of :func:`price_in_order`."""
    out = []
    for f, m in priced:
        even = redistributed(f)
        rows, values = fix_of(costs, m, even=even, steady=uncapped(f) and not even)
        out.append(Candidate(f, m, rows, values, cap=not uncapped(f)))
    for i, (_, m) in enumerate(priced):  # ties: the first holds nothing of its twin
        out[i].held = [j for j, (_, m2) in enumerate(priced) if j != i and m2.any()
                       and not (m2 & ~m).any() and ((m & ~m2).any() or j < i)]  # fmt: skip
    stalls = [f for f in findings if f["kind"] == "data_stall" and f["severity"] >= NOISE]
    if stalls:
        names = ctx.run.query("findings/data_span_names")["name"].tolist()
        for f in stalls:
            m = costs.ranks_compute(f["ranks"]) & np.isin(costs.label, names)
            if m.any():
                rows, values = fix_of(costs, m, even=False, steady=False)
                out.append(Candidate(f, m, rows, values, stall=float(f["severity"])))
    return out


def fix_of(
    costs: Costs, mask: np.ndarray, even: bool, steady: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The slots a fix changes and their durations then (see :meth:`Costs.saving`)."""
    d = costs.evened(mask) if even else costs.fixed(mask, steady=mask if steady else None)
    rows = np.flatnonzero((d != costs.w.measured).any(axis=1) | mask)
    return rows, d[rows]


def price_in_order(costs: Costs, cands: list[Candidate]) -> tuple[list[int], list[int]]:
    """Sets each priced candidate's severity and evidence; the indices of the findings kept,
    in the order they were fixed, and of those dismissed (data stalls are in neither)."""
    d = costs.w.measured.copy()
    t_base = costs.t
    todo = list(range(len(cands)))
    kept: list[int] = []
    fixed_first: list[int] = []  # kept findings and data stalls, in order
    dismissed: list[int] = []
    first = True
    while todo:
        for i in todo:
            c = cands[i]
            c.last = c.stall if c.stall is not None else _conditional(costs, cands, c, d, t_base)
            if first:
                c.alone = c.last
        first = False
        open_ = [i for i in todo if not set(cands[i].held) & set(todo)]
        best = max(open_, key=lambda i: cands[i].last, default=None)
        if best is None or cands[best].last < NOISE:
            if not open_ or len(open_) == len(todo):
                break
            for i in open_:  # the held ones save too little: their holders are priced next
                todo.remove(i)
                if cands[i].stall is None:
                    dismissed.append(i)
                    _record(cands, i, fixed_first)
            continue
        c = cands[best]
        todo.remove(best)
        d[c.rows] = c.values
        t_base = float(np.mean(costs.w.replayer.run(d)))
        if c.stall is None:
            kept.append(best)
            _record(cands, best, fixed_first)
        fixed_first.append(best)
    for i in todo:
        if cands[i].stall is None:
            dismissed.append(i)
            _record(cands, i, fixed_first)
    return kept, dismissed


def _conditional(
    costs: Costs, cands: list[Candidate], c: Candidate, d: np.ndarray, t_base: float
) -> float:
    """1 - T(d with c fixed) / T(d), beyond the candidates ``c`` holds (fixed in its base)."""
    if t_base <= 0 or not len(c.rows):
        return 0.0
    base = d
    if c.held:
        base = d.copy()
        for j in c.held:
            base[cands[j].rows] = cands[j].values
        t_base = float(np.mean(costs.w.replayer.run(base)))
        if t_base <= 0:
            return 0.0
    trial = base.copy()
    trial[c.rows] = c.values
    s = 1.0 - float(np.mean(costs.w.replayer.run(trial))) / t_base
    return min(s, costs.total) if c.cap else s


def _record(cands: list[Candidate], i: int, before: list[int]) -> None:
    """Severity and evidence of priced candidate ``i``, fixed after ``before``."""
    c = cands[i]
    ev = c.f["evidence"]
    ev["estimate"] = c.f["severity"]
    ev["saving_alone"] = round(max(c.alone, 0.0), 4)
    if before:
        ev["saving_after_others"] = round(max(c.last, 0.0), 4)
        ev["fixed_first"] = [{"kind": cands[j].f["kind"], "ranks": cands[j].f["ranks"]}
                             for j in before]  # fmt: skip
    if c.held:
        ev["beyond"] = [{"kind": cands[j].f["kind"], "ranks": cands[j].f["ranks"]} for j in c.held]
    c.f["severity"] = round(max(c.last, 0.0), 4)
