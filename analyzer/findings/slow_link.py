"""Slow link: transfers between two ranks (or within one group) slower than comparable ones."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.findings.common import Context, bandwidth, finding, ms
from analyzer.findings.detector import DetectorSpec, Kind, Replay
from analyzer.findings.record import Evidence, Finding

LATE_SHARE = 0.5  # a transfer counts as slow above 1 + half the required excess
MAX_SUSPECTS = 8  # at scale: units matched exactly because the digest suspects them...
REFERENCES = 4  # ...and per class of suspect, units nearest the class median, for reference


def _members(ctx: Context, unit: pd.Series) -> list[int]:
    if unit.unit_b >= 0:
        return [int(unit.unit_a), int(unit.unit_b)]
    df = ctx.group_members
    sel = df[(df["group"] == unit["group"]) & (df.gid == unit.unit_a)]
    return [int(r) for r in sel["rank"]]


def _name_pair(slow: list[tuple[pd.Series, list[int]]], i: int) -> list[int] | None:
    """The two ends of the link behind slow unit ``i``: the unit itself when it has two
    members, else its intersection with a slow unit of another kind when that leaves two."""
    unit, members = slow[i]
    if len(members) == 2:
        return members
    for j, (other, other_members) in enumerate(slow):
        if j != i and other["group"] != unit["group"]:
            common = sorted(set(members) & set(other_members))
            if len(common) == 2:
                return common
    return None


def detect(ctx: Context) -> list[Finding]:
    """Name links whose transfers are persistently slower than those of comparable links.

    Algorithm:

    1. For every complete collective instance, the transfer time is its end minus the LAST
       member's arrival, so waiting for a late rank is not counted: a slow link is not a late
       rank. Bus bandwidth uses the nccl-tests factors with the group's own size (all-reduce
       2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; send/recv, broadcast 1).
    2. Each transfer is compared with the same transfer elsewhere (findings/link_units.sql):
       the k-th all_gather of a size in a tp group's step with the k-th of that size in the
       other tp groups' step (not seq k: the tp groups of different pipeline stages run
       different sequences, the last stage's the loss's collectives too), a send/recv per byte
       with the same seq between the same two pipeline stages on the other pipeline links; the
       ratio is to their median.
    3. A unit (group or pair) is slow when its median ratio is at least 1 + ``link_excess``,
       it is above half that in ``persistence`` of its transfers, and the excess stands ``z``
       standard errors above the noise of its kind. The factor reported is that median ratio:
       how many times as long its transfer phases (last arrival to end) take as the same
       transfers on the comparable links, the fault language's slow_link factor (SPEC §3).
    4. The pair is named from a slow send/recv pair or a two-member group directly, else by
       intersecting slow groups of different kinds; when no pair can be told apart, the
       finding names the group's members.

    Severity (what-if): the median per step of the extra transfer time (transfer minus the
    comparable median, summed over the unit's transfers in the step) over the median step.
    Collectives block their members, so the extra time lies on the step's critical path.
    """
    slow = [(u, _members(ctx, u)) for _, u in _slow_units(ctx).iterrows()]
    out: dict[tuple[int, ...], Finding] = {}
    for i, (u, members) in enumerate(slow):
        pair = _name_pair(slow, i)
        ranks = pair or members
        ev = _evidence(u, members, pair is not None)
        key = tuple(ranks)
        if key in out:
            out[key]["evidence"].setdefault("also", []).append(ev)
            continue
        sev = u.excess_ns_per_step / ctx.median_step_ns
        out[key] = finding(ctx, "slow_link", ranks, sev, _message(u, ranks, members, pair), ev)
    return list(out.values())


def _slow_units(ctx: Context) -> pd.DataFrame:
    """The units (groups or pairs) slow beyond the thresholds (:func:`detect`'s step 3), the
    one that costs the most first: it speaks for its link, the others are its ``also``."""
    th = ctx.thresholds
    units = _units(ctx, late=1 + th.link_excess * LATE_SHARE)
    if units.empty:
        return units
    units["peer_busbw"] = _peer_busbw(units)
    excess = units.ratio - 1
    stderr = 1.25 * units.sigma / np.sqrt(units.n.clip(lower=1))
    chosen = units[
        units.suspect
        & (units.n >= 3)
        & (units.late_frac >= th.persistence)
        & (excess >= th.link_excess)
        & (excess >= th.z * stderr)
    ]
    return chosen.sort_values("excess_ns_per_step", ascending=False, kind="stable")


def _evidence(u: pd.Series, members: list[int], pair_known: bool) -> Evidence:
    """A slow unit's numbers (docs/spec.md §3)."""
    return {
        "group": u["group"],
        "members": members,
        "pair_known": pair_known,
        "ops": u.ops,
        "transfer_ratio": u.ratio,
        "slow_transfers": round(u.late_frac * u.n),
        "transfers_compared": int(u.n),
        "comparable_links": int(u.peers),
        "steps_compared": int(u.steps),
        "busbw_gbps": u.busbw,
        "peer_busbw_gbps": u.peer_busbw,
        "excess_ms_per_step": ms(u.excess_ns_per_step),
    }


def _message(u: pd.Series, ranks: list[int], members: list[int], pair: list[int] | None) -> str:
    """The finding's words: which link, what is slow, against what."""
    where = f"ranks {ranks[0]}-{ranks[1]}" if pair else f"{u['group']} group {members}"
    if u.unit_b >= 0:
        what = "send/recv transfers (per byte)"
        others = f"the same transfers on {int(u.peers)} comparable links"
    else:
        what = f"{u['group']} {u.ops}"
        plural = "s" if u.peers != 1 else ""
        others = f"the same collectives in {int(u.peers)} other {u['group']} group{plural}"
    msg = (
        f"link {where}: {what} take {u.ratio:.2f}x as long from the last arrival to the end "
        f"as {others} (median of {int(u.n)}; {round(u.late_frac * u.n)} of them longer)"
    )
    if u.busbw == u.busbw:
        msg += f"; bus bandwidth {bandwidth(u.busbw)} vs {bandwidth(u.peer_busbw)}"
    return msg


def _units(ctx: Context, late: float) -> pd.DataFrame:
    """findings/link_units over the whole run, or at scale over suspects and references.

    Matching every collective of a 12,288-rank run costs more than the rest of the analysis,
    so at scale (``Context.at_scale``) the digest names suspects first
    (findings/link_candidates.sql: a unit whose fastest member is slower than its class's
    units in most steps), at most ``MAX_SUSPECTS`` of them, and ``REFERENCES`` units per class
    of suspect nearest the class median; the exact comparison then runs over those units'
    ranks only, and only suspects (column ``suspect``) can be named.
    """
    if not ctx.at_scale:
        units = ctx.run.query("findings/link_units", lo=ctx.lo, hi=ctx.hi, late=late)
        return units.assign(suspect=True)
    th = ctx.thresholds
    cand = ctx.run.query("findings/link_candidates", lo=ctx.lo, hi=ctx.hi, late=late)
    cand = cand[cand.n >= 3]
    suspects = cand[(cand.ratio >= late) & (cand.late_frac >= th.persistence)]
    suspects = suspects.nlargest(MAX_SUSPECTS, "ratio")
    if suspects.empty:
        return pd.DataFrame()
    keys = ["group", "class_a", "class_b"]
    pool = cand.merge(suspects[keys].drop_duplicates(), on=keys)
    pool = pool[~pool.index.isin(suspects.index)]
    refs = (
        pool.assign(dist=(pool.ratio - 1).abs())
        .sort_values("dist")
        .groupby(keys, dropna=False)
        .head(REFERENCES)
    )
    chosen = pd.concat([suspects, refs])
    ranks = {r for _, u in chosen.iterrows() for r in _members(ctx, u)}
    units = ctx.matching(ranks).query("findings/link_units", lo=ctx.lo, hi=ctx.hi, late=late)
    unit_keys = ["group", "unit_a", "unit_b"]
    marked = suspects[unit_keys].assign(suspect=True)
    units = units.merge(marked, on=unit_keys, how="left")
    return units.assign(suspect=units.suspect.fillna(False).astype(bool))


def _peer_busbw(units: pd.DataFrame) -> pd.Series:
    """Median bus bandwidth of the comparable units: same group kind and ops, the unit left
    out."""
    out = pd.Series(np.nan, index=units.index)
    for _, same in units.groupby(["group", "ops"]):
        for i in same.index:
            others = same.busbw.drop(i).dropna()
            if len(others):
                out[i] = others.median()
    return out


def fix(replay: Replay, f: Finding) -> np.ndarray:
    """Fixed in the what-if replay: the transfers between the link's ends, in its groups."""
    ev = f["evidence"]
    groups = {ev.get("group")} | {a.get("group") for a in ev.get("also", [])}
    return replay.link(list(ev.get("members") or f["ranks"]), {g for g in groups if g})


DETECTOR = DetectorSpec("slow_link", detect, (Kind("slow_link", fix=fix),))
