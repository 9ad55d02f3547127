"""Load imbalance by work given: a rank that is last because it was given more work.

The straggler detector finds candidate ranks whose own time is N times their peers' (the other
ranks of their pipeline stage and context shard, step by step). A rank can be that slow because
its GPU is, or because it had more to do: its replica was given longer sequences
(``seq_skew``), or the router sent more tokens to the experts it holds (``hot_expert``).
The ``work`` table (docs/spec.md §2) tells which: for each candidate and each kind of work
(findings/work_given.sql) its *work ratio* is its work in a step over the median of the same
peers' (the rank itself left out), the median over the steps analyzed:

* ``tokens``: its replica's tokens;
* ``attention``: the sum of its replica's squared document lengths (causal attention's work);
* ``expert_tokens``: the token assignments the experts it holds received, summed;
* ``a2a_bytes``: the bytes all_to_alls sent to it (``a2a_sent`` rows keyed by it).

The extra work *explains* the extra time when a work ratio is at least ``1 + (N - 1) / 2``
(:func:`explains`): a rank with twice the work and twice the time is explained; so is one whose
share of work-driven compute is only part of its time (an MoE layer's experts are about two
thirds of its compute, so twice the expert tokens read 1.67x the time), while a rank with even
work (ratio ~1) never is. Such candidates become one ``load_imbalance`` finding per cause
instead of stragglers, naming every rank given the extra work (the whole replica for sequence
skew, every holder of a hot expert, whether or not each passed the straggler's tests), never
the ranks that wait for them. Extra expert tokens without a hot expert, beside a replica given
more tokens, are that replica's tokens reaching its expert group: one cause, its holders join
the replica's finding (``routed``). A candidate whose work is even stays a straggler, its evidence
saying so (``work.work_ratio`` ~1: the same work, slower).

Severity: fixing the ranks' compute at their peers' median, as for a straggler
(:mod:`analyzer.findings.severity.cost`); the estimate, the largest median excess of a candidate's own
time per step over the median step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from analyzer.findings.common import Context, finding, ms, peer_reference
from analyzer.findings.detector import Kind, Replay
from analyzer.findings.record import Evidence, Finding

KINDS = ("tokens", "attention", "expert_tokens", "a2a_bytes")  # preferred in this order
WHAT = {
    "tokens": "the tokens",
    "attention": "the attention work (sum of squared document lengths)",
    "expert_tokens": "the expert token assignments",
    "a2a_bytes": "the all_to_all bytes",
}
TOP_STEPS = 5


def explains(work_ratio: float, time_ratio: float) -> bool:
    """Whether ``work_ratio`` times the peers' work accounts for ``time_ratio`` times their time:
    at least half of the excess time's worth of extra work."""
    return bool(np.isfinite(work_ratio)) and work_ratio >= 1.0 + (time_ratio - 1.0) / 2.0


STEADY = 0.9  # extra work steadily given: ahead of the peers in this share of the steps


class Given:
    """The work table of the window: per (rank, step, kind) the work and its ratio to peers."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        rows = ctx.run.query("findings/work_given", lo=ctx.lo, hi=ctx.hi)
        if not rows.empty:
            coords = ctx.coords[["pp", "cp", "dp"]]
            rows = rows.join(coords, on="rank", how="inner")
            rows = rows.assign(ref=peer_reference(rows, ["step", "kind", "pp", "cp"], "value"))
            rows = rows[rows.ref > 0]
            rows = rows.assign(ratio=rows.value / rows.ref)
        self.rows = rows
        med = rows.groupby(["rank", "kind"]).ratio.median() if not rows.empty else None
        self.ratios = med.unstack("kind") if med is not None else pd.DataFrame()
        # the share of the steps in which the rank had more work than its peers
        if rows.empty:
            self.ahead = pd.DataFrame()
        else:
            ahead = (rows.ratio > 1.0).groupby([rows["rank"], rows["kind"]]).mean()
            self.ahead = ahead.unstack("kind")

    @cached_property
    def experts(self) -> pd.DataFrame:
        """Per expert: its assignments over the window and its holders (expert_load.sql)."""
        return self.ctx.run.query("findings/expert_load", lo=self.ctx.lo, hi=self.ctx.hi)

    @property
    def empty(self) -> bool:
        """Whether the window recorded no work to compare."""
        return self.ratios.empty

    def of(self, rank: int) -> dict[str, float]:
        """The rank's median work ratio per kind recorded."""
        if rank not in self.ratios.index:
            return {}
        row = self.ratios.loc[rank].dropna()
        return {k: float(row[k]) for k in KINDS if k in row.index}

    def explaining(self, rank: int, time_ratio: float) -> str | None:
        """The first kind of work (in :data:`KINDS` order) that explains the rank's time and
        was given steadily: more than its peers in :data:`STEADY` of the steps (a hot expert's
        share may drift as the router learns; it stays ahead). Work uneven at random
        (sequence lengths drawn afresh every step) leaves a replica ahead over a window by
        chance, not in nine steps of ten; that is the spread imbalance, which no rank causes
        (cost.py)."""
        ratios = self.of(rank)
        return next(
            (k for k in KINDS
             if k in ratios and explains(ratios[k], time_ratio) and self.steady(rank, k)),
            None,
        )  # fmt: skip

    def steady(self, rank: int, kind: str) -> bool:
        """Whether the rank's extra work of ``kind`` is steady (see :meth:`explaining`)."""
        try:
            return float(self.ahead.loc[rank, kind]) >= STEADY
        except KeyError:
            return False

    def evidence(self, rank: int, time_ratio: float) -> dict[str, Any] | None:
        """``work`` evidence of a rank that stays a straggler: its largest work ratio."""
        ratios = self.of(rank)
        if not ratios:
            return None
        kind = max(ratios, key=lambda k: ratios[k])
        return {"kind": kind, "work_ratio": ratios[kind], "time_ratio": time_ratio,
                "ratios": ratios}  # fmt: skip


GIVEN_SCREEN = 1.25  # work ratio that makes a rank a candidate by itself (screen)


def screen(
    ctx: Context, per_rank: pd.DataFrame, cpu_ratio: pd.Series | None = None
) -> tuple[pd.Index, Given | None]:
    """Ranks that were given steadily more work than their peers (a work ratio of at least
    :data:`GIVEN_SCREEN`, ahead in :data:`STEADY` of the steps) and take longer than them
    at all (a median ratio above 1 of their own time outside waits, or of their training
    thread's CPU time, ``cpu_ratio``, where ranks share cores and the first swings with the
    scheduling): candidates whatever their time's excess, since on a
    small share of a step (a hot expert of a model whose experts are a tenth of its compute)
    the extra work is real while the excess sits near the noise that the straggler's own
    gates are set against. :func:`split` then decides what the work explains, and the
    what-if prices it. Returns the ranks and the work read (None when the run has none)."""
    given = Given(ctx)
    if given.empty:
        return per_rank.index[:0], None
    heavy = {
        int(r)
        for r in given.ratios.index
        for k in KINDS
        if k in given.ratios.columns
        and float(given.ratios.loc[r, k]) >= GIVEN_SCREEN
        and given.steady(int(r), k)
    }
    slower = per_rank.ratio > 1.0
    if cpu_ratio is not None and not cpu_ratio.empty:
        slower |= cpu_ratio.reindex(per_rank.index).fillna(0.0) > 1.0
    ranks = per_rank.index[slower]
    return ranks[ranks.isin(list(heavy))], given


# a cause of extra work: its kind and, for expert tokens, the hot expert (-1: none)
Cause = tuple[str, int]


@dataclass
class Part:
    """One cause's finding before it is made one (:func:`split` may merge two)."""

    ranks: list[int]
    evidence: Evidence
    message: str
    estimate: float  # the severity estimate


def split(
    ctx: Context, candidates: pd.DataFrame, given: Given | None = None
) -> tuple[list[Finding], set[int], Given | None]:
    """The candidates (the straggler detector's per-rank frame: ratio, excess_ns...) whose
    extra work explains their time, as load_imbalance findings; the ranks explained; and the
    work read (None when the run recorded none; ``given``: what :func:`screen` read)."""
    if candidates.empty:
        return [], set(), given
    given = given if given is not None else Given(ctx)
    if given.empty:
        return [], set(), None
    causes: dict[Cause, list[int]] = {}
    for rank, row in candidates.iterrows():
        kind = given.explaining(int(rank), float(row.ratio))
        if kind is None:
            continue
        cause = (kind, _hot_expert(given, int(rank)) if kind == "expert_tokens" else -1)
        causes.setdefault(cause, []).append(int(rank))
    parts: list[Part] = []  # each cause's
    explained: set[int] = set()
    named: set[int] = set()
    for cause in sorted(causes, key=lambda c: KINDS.index(c[0])):
        ranks = causes[cause]
        explained |= set(ranks)
        part = _finding(ctx, given, candidates.loc[ranks], cause, named)
        named |= set(part.ranks)
        routed = part.evidence["work"]["kind"] == "expert_tokens" and "expert" not in part.evidence
        if routed and parts and parts[0].evidence["work"]["kind"] in ("tokens", "attention"):
            # no hot expert: a replica's extra tokens reached its expert group's experts, whose
            # holders compute more for it; one cause, one finding
            first = parts[0]
            first.ranks.extend(part.ranks)
            first.evidence["routed"] = {"ranks": part.ranks, **part.evidence["work"]}
            first.message += (
                f"; its tokens also reached the experts of ranks {_list(part.ranks)}, which "
                f"received {part.evidence['work']['work_ratio']:.1f}x their peers' expert tokens"
            )
            continue
        parts.append(part)
    out = [finding(ctx, "load_imbalance", p.ranks, p.estimate, p.message, p.evidence)
           for p in parts]  # fmt: skip
    return out, explained, given


def _hot_expert(given: Given, rank: int) -> int:
    """Of the experts ``rank`` holds, the one that received the most assignments."""
    load = given.experts
    mine = load[load.holders.apply(lambda h: rank in list(h))]
    return int(mine.expert.iloc[int(np.argmax(mine.assignments))]) if len(mine) else -1


def _finding(
    ctx: Context, given: Given, cands: pd.DataFrame, cause: Cause, named: set[int]
) -> Part:
    """One cause's finding, to be. ``named``: ranks an earlier cause (tokens before expert tokens)
    already names, left out of this one."""
    kind = cause[0]
    time_ratio = float(cands.ratio.median())
    work_ratio = float(np.median([given.of(int(r))[kind] for r in cands.index]))
    # every rank given the extra work, not only those that passed as candidates
    threshold = 1.0 + (time_ratio - 1.0) / 2.0
    heavy = given.ratios.index[given.ratios.get(kind, pd.Series(dtype=float)) >= threshold]
    ranks = sorted(({int(r) for r in heavy} | {int(r) for r in cands.index}) - named)
    evidence: dict[str, Any] = {
        "work": {"kind": kind, "work_ratio": work_ratio, "time_ratio": time_ratio},
        "candidates": sorted(int(r) for r in cands.index),
        "excess_ms_per_step": ms(float(cands.excess_ns.max())),
        "steps_compared": int(cands.n.max()),
    }
    load = given.experts
    row = load[load.expert == cause[1]] if kind == "expert_tokens" else load.iloc[:0]
    holders = sorted(int(r) for r in row.holders.iloc[0]) if len(row) else []
    if holders and set(holders) <= set(ranks) | named:
        # a hot expert: all its holders have the extra work (the ranks given more expert
        # tokens for another reason, a replica's extra tokens in their group, are not)
        expert = int(cause[1])
        total = float(load.assignments.sum())
        ranks = holders
        row = row.iloc[0]
        share, even = float(row.assignments) / total, 1.0 / len(load)
        evidence["expert"] = {"id": expert, "share": share, "even_share": even,
                              "holders": holders}  # fmt: skip
        msg = (
            f"expert {expert}, held by ranks {_list(holders)}, received {share:.0%} of the "
            f"token assignments (even: {even:.0%}): its holders compute {time_ratio:.2f}x as "
            f"long as their peers (their experts' tokens: {work_ratio:.2f}x the peers')"
        )
    else:
        steps = _steps(given, ranks, kind)
        evidence["steps"] = list(steps.index)
        evidence["step_work_ratios"] = {str(s): round(float(v), 4) for s, v in steps.items()}
        dps = sorted({ctx.coord(r)["dp"] for r in ranks})
        where = ", ".join(f"dp{d}" for d in dps)
        why = " (sequence-length skew)" if kind in ("tokens", "attention") else ""
        ranks = ranks or sorted(int(r) for r in cands.index)
        msg = (
            f"ranks {_list(ranks)} ({where}) were given {work_ratio:.1f}x {WHAT[kind]} of their "
            f"peers{why} and compute {time_ratio:.2f}x as long"
        )
    estimate = float(cands.excess_ns.max()) / ctx.median_step_ns
    return Part(ranks, evidence, msg, estimate)


def _steps(given: Given, ranks: list[int], kind: str) -> pd.Series:
    """The steps in which ``ranks`` had the most extra work of ``kind`` (their median ratio)."""
    rows = given.rows
    mine = rows[(rows.kind == kind) & rows["rank"].isin(ranks)]
    per = mine.groupby("step").ratio.median().sort_values(ascending=False, kind="stable")
    return per.head(TOP_STEPS)


def _list(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:16])
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def fix(replay: Replay, f: Finding) -> np.ndarray | None:
    """Fixed in the what-if replay: a load imbalance by work given, its ranks' compute; the
    spread one (no ``work`` in its evidence) is not priced there (its share is its severity)."""
    return replay.ranks_compute(f["ranks"]) if "work" in f["evidence"] else None


# emitted by the straggler detector (its candidates explained by their work) and by the
# pricing's spread imbalance (analyzer.findings.spread_imbalance)
LOAD_IMBALANCE = Kind("load_imbalance", explains=True, fix=fix)
