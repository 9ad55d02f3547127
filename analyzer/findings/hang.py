"""Hang and crash: ranks that never entered the collective the others wait in, or stopped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from analyzer.findings.common import Context, finding

STACK_CHARS = 4000


@dataclass(frozen=True)
class Wait:
    """Members of one channel stuck at ``seq`` while ``missing`` never got there."""

    group: str
    gid: int
    src: int
    dst: int
    seq: int
    op: str
    step: int
    waiting: tuple[int, ...]
    missing: tuple[int, ...]
    unfinished: bool

    def describe(self) -> dict[str, Any]:
        where = f"{self.group}" + (
            f" {self.src}->{self.dst}" if self.src >= 0 else f" group {self.gid}"
        )
        return {
            "group": self.group,
            "channel": where,
            "op": self.op,
            "seq": self.seq,
            "step": self.step,
            "waiting_ranks": list(self.waiting),
            "missing_ranks": list(self.missing),
        }


def frontier(ctx: Context) -> list[Wait]:
    """For every channel whose members did not all reach the same last seq, the wait there.

    A channel is one process group ((group, gid): all members issue the same seqs) or one
    direction of a send/recv pair. The members at the highest seq form the front; members
    behind it (or that never used the channel) are missing from that collective. The wait is
    ``unfinished`` when a front member's row there has no end: it was blocked in it.
    """
    ctx.run.ensure_frontier()
    fr = ctx.run.query("findings/channel_frontier")
    keys = ["group", "gid", "src", "dst"]
    top = fr.groupby(keys, dropna=False).last_seq.transform("max")
    behind = top.notna() & (fr.last_seq.isna() | (fr.last_seq < top))
    # only channels with a member behind the front (none in a healthy run of 12,288 ranks)
    stuck = fr[keys].loc[behind].drop_duplicates()
    fr = fr.merge(stuck, on=keys)
    waits = []
    for (group, gid, src, dst), ch in fr.groupby(keys, dropna=False):
        top = ch.last_seq.max()
        front = ch[ch.last_seq == top]
        behind = ch[ch.last_seq.isna() | (ch.last_seq < top)]
        blocked = front[front.last_unfinished.astype(bool)]
        waiting = blocked if not blocked.empty else front
        waits.append(
            Wait(
                group=str(group),
                gid=int(gid),
                src=int(src),
                dst=int(dst),
                seq=int(top),
                op=str(front.last_op.iloc[0]),
                step=int(front.last_step.max()),
                waiting=tuple(sorted(int(r) for r in waiting["rank"])),
                missing=tuple(sorted(int(r) for r in behind["rank"].unique())),
                unfinished=not blocked.empty,
            )
        )
    return waits


def _root_culprits(waits: list[Wait]) -> list[int]:
    """Missing ranks that are not themselves blocked waiting for someone else."""
    blocked = {r for w in waits if w.unfinished for r in w.waiting}
    missing = {r for w in waits if w.unfinished for r in w.missing}
    roots = sorted(missing - blocked)
    return roots or sorted(missing)


def _stack(ctx: Context, rank: int) -> str | None:
    df = ctx.run.query("findings/rank_stack", rank=rank)
    if df.empty:
        return None
    return str(df["stack"].iloc[0])[:STACK_CHARS]


def _behind(activity: pd.DataFrame, rank: int, margin: int) -> bool:
    """Whether ``rank``'s records stop at least ``margin`` steps before the furthest other's."""
    known = activity.dropna(subset=["last_step"])
    others = known[known["rank"] != rank]
    if others.empty:
        return False
    mine = activity[activity["rank"] == rank].last_step
    if mine.empty or pd.isna(mine.iloc[0]):
        return True
    return int(others.last_step.max()) - int(mine.iloc[0]) >= margin


def _crashed(ctx: Context, activity: pd.DataFrame, roots: list[int]) -> list[int]:
    """Ranks that stopped reporting while the others went on or waited (see ``detect``).

    Only in a run that failed. Of the culprits no stack could be taken of (a dead process has
    none), those whose records stop before the others' crashed; a culprit that reported as far
    as the others most likely failed because a crashed peer's connections closed (when none
    stopped early, all of them are reported). Any other rank whose records stop before the
    others' crashed too.
    """
    if ctx.run.meta.get("status") != "failed":
        return []
    stacks = dict(zip(activity["rank"], activity.n_stacks, strict=False))
    dead = [r for r in roots if stacks.get(r, 0) == 0]
    early = [r for r in dead if _behind(activity, r, 1)]
    crashed = set(early or dead)
    crashed |= {int(r) for r in activity["rank"] if r not in roots and _behind(activity, r, 1)}
    return sorted(crashed)


def detect(ctx: Context) -> list[dict[str, Any]]:
    """Name the ranks a hung job waits for, and the ranks that crashed.

    Algorithm (works on traced runs and on imported Flight Recorder dumps, which carry no
    timing: a collective that never completed simply has no end):

    1. ``frontier``: per channel, the last seq each member reached; members behind the front
       are missing from the collective the front waits in.
    2. Only waits where a front member is blocked (its row has no end) count. The culprits are
       the missing ranks that are not blocked in any collective themselves: a rank waiting for
       the culprit in one group is in turn missing from another group, and must not be blamed.
    3. A culprit is reported as ``crash`` when the run failed (run.json status) and no stack
       could be taken of it (a dead process has none); otherwise as ``hang``, with the stack
       taken of it when there is one. Ranks whose records stop steps before the others' in a
       failed run are ``crash`` too (others went on without them).

    Severity: 1.0, the job makes no progress (a what-if without the fault recovers it all).
    """
    if ctx.run.meta.get("status") == "finished" and not ctx.unfinished:
        return []  # every rank finished every collective it started: nothing hung or died
    waits = frontier(ctx)
    live = [w for w in waits if w.unfinished]
    roots = _root_culprits(live) if live else []
    if not roots and ctx.run.meta.get("status") != "failed":
        return []  # nothing waits and nothing failed: no need to read the heartbeats
    activity = ctx.run.query("findings/rank_activity")
    crashed = _crashed(ctx, activity, roots)
    if crashed:  # culprits that reported as far as the others went down with the crashed
        roots = [r for r in roots if r in crashed or _behind(activity, r, 1)]
    hung = [r for r in roots if r not in crashed]
    out = []
    if hung:
        out.append(_hang_finding(ctx, hung, live))
    if crashed:
        out.append(_crash_finding(ctx, crashed, live, activity))
    return out


def _relevant(waits: list[Wait], ranks: list[int]) -> list[Wait]:
    mine = [w for w in waits if set(w.missing) & set(ranks)]
    return sorted(mine, key=lambda w: (w.src >= 0, -len(w.waiting), w.group, w.gid))


def _hang_finding(ctx: Context, ranks: list[int], waits: list[Wait]) -> dict[str, Any]:
    mine = _relevant(waits, ranks)
    main = mine[0]
    waiting = sorted({r for w in mine for r in w.waiting} - set(ranks))
    stacks = {str(r): s for r in ranks if (s := _stack(ctx, r)) is not None}
    evidence = {
        **main.describe(),
        "waiting_ranks": waiting,
        "waits": [w.describe() for w in mine[:20]],
        "stacks": stacks,
        "status": ctx.run.meta.get("status"),
    }
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    at = f" (step {main.step})" if main.step >= 0 else ""
    msg = (
        f"hang: {who} never entered {main.op} seq {main.seq} of {main.describe()['channel']}"
        f"{at}; {len(waiting)} ranks wait for {'it' if len(ranks) == 1 else 'them'}"
    )
    if stacks:
        first = next(iter(stacks.values())).strip().splitlines()
        msg += f"; stack taken: {first[0].strip() if first else '?'}"
    return finding(ctx, "hang", ranks, 1.0, msg, evidence, steps=[main.step, main.step])


def _crash_finding(
    ctx: Context, ranks: list[int], waits: list[Wait], activity: pd.DataFrame
) -> dict[str, Any]:
    mine = _relevant(waits, ranks)
    last = activity.set_index("rank").reindex(ranks)
    last_steps = {str(r): (None if pd.isna(s) else int(s)) for r, s in last.last_step.items()}
    others = activity[~activity["rank"].isin(ranks)].last_step.max()
    evidence = {
        "last_step": last_steps,
        "others_last_step": None if pd.isna(others) else int(others),
        "status": ctx.run.meta.get("status"),
        "waits": [w.describe() for w in mine[:20]],
    }
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    stop = [s for s in last_steps.values() if s is not None]
    msg = f"crash: {who} stopped reporting" + (f" (last record: step {max(stop)})" if stop else "")
    if mine:
        waiting = sorted({r for w in mine for r in w.waiting} - set(ranks))
        msg += f"; {len(waiting)} ranks were left waiting in {mine[0].op} ({mine[0].group})"
    elif others == others:
        msg += f" while the others went on to step {int(others)}"
    step = max(stop) if stop else ctx.hi
    return finding(ctx, "crash", ranks, 1.0, msg, evidence, steps=[step, step])
