"""Hang and crash: the ranks at the root of what a stopped job waits for.

Algorithm (traced runs and imported Flight Recorder dumps alike; a collective that never
completed simply has no end):

1. The wait-for graph (:mod:`analyzer.waits.graph`), from every channel's last entered,
   last finished and unfinished seqs (tp, pp, dp, ep, cp, any named group, each send/recv
   direction): who waits in what, for whom. Its roots are the culprits; every other rank that
   is stuck is a victim, reported in the evidence grouped by the operation it waits in, never
   in ``ranks``.
   While the run is still running, only a root whose own watchdog said it hung (a ``hang``
   heartbeat or a stack taken on the hang) is one: a look at a live run reads each rank as of
   its last flush, and a slow rank is behind its peers at every instant. A run that says it is
   running but from which no rank was heard for the tracer's hang timeout (its own, from
   run.json) stopped without a word: its roots are named as in a hung run
   (:func:`live_roots`).
2. A hang without peers: when nothing waits for anyone (one rank, or collectives that were not
   recorded), a run that ended ``hung`` or ``failed`` still names the ranks that stopped (a
   ``hang`` heartbeat or a stack taken on the hang; else every rank that reported; else every
   rank) and, of those, the ones whose records stop at the earliest step.
3. ``crash`` or ``hang``: in a run that failed (run.json status), a culprit that never closed
   (no ``end`` heartbeat) and of which no stack was taken is dead: ``crash``. The ranks torn
   down with the job after a crash (alive to the end, stuck in nothing) are neither. Every other
   culprit is a ``hang``, with the stack taken of it. Dead ranks nobody waited for whose
   records stop before the others' crashed too.

One finding per kind: two independent dead ranks make one ``crash`` naming both.
Severity: 1.0, the job makes no progress (a what-if without the fault recovers it all).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import pandas as pd

from analyzer.findings.common import Context, finding
from analyzer.findings.detector import DetectorSpec, Kind
from analyzer.findings.record import Finding
from analyzer.waits import graph as waitgraph
from analyzer.waits.graph import WaitGraph
from analyzer.waits.model import Edge, Op
from tracer.config import TracerConfig

STACK_CHARS = 4000
MAX_LISTED = 20  # waits and victim groups listed in the evidence
MAX_RANKS_LISTED = 64  # ranks listed per victim group


def _stack(ctx: Context, rank: int) -> str | None:
    df = ctx.run.query("findings/rank_stack", rank=rank)
    if df.empty:
        return None
    return str(df["stack"].iloc[0])[:STACK_CHARS]


def _last_step(activity: pd.DataFrame, rank: int) -> int | None:
    row = activity[activity["rank"] == rank]
    if row.empty or pd.isna(row.last_step.iloc[0]):
        return None
    return int(row.last_step.iloc[0])


def _behind(activity: pd.DataFrame, rank: int, margin: int = 1) -> bool:
    """Whether ``rank``'s records stop at least ``margin`` steps before the furthest other's."""
    known = activity.dropna(subset=["last_step"])
    others = known[known["rank"] != rank]
    if others.empty:
        return False
    mine = _last_step(activity, rank)
    return mine is None or int(others.last_step.max()) - mine >= margin


def graph_of(ctx: Context, activity: pd.DataFrame | None = None) -> WaitGraph:
    """The run's wait-for graph (pipelines taken from the ``pp`` groups; ranks without any
    record count as the first to stop)."""
    ctx.run.ensure_frontier()
    frontier = ctx.run.query("findings/channel_frontier")
    if activity is None:
        activity = ctx.run.query("findings/rank_activity")
    silent = [int(r) for r in activity["rank"][~activity.has_records.astype(bool)]]
    blocking = not str(ctx.run.meta.get("device", "")).startswith("cuda")  # gloo: CPU waits
    return waitgraph.build(
        frontier, waitgraph.pipeline_neighbours(ctx.group_members), silent, blocking
    )


def _stopped(activity: pd.DataFrame) -> list[int]:
    """A hang without peers: the ranks that stopped first (see the module docstring, 2)."""
    said = activity[activity.has_hang_beat | (activity.n_hang_stacks > 0)]
    pool = said if not said.empty else activity[activity.has_records]
    if pool.empty:  # nobody reported anything: every rank stopped before its first flush
        pool = activity
    steps = pool.last_step.fillna(-1)
    return sorted(int(r) for r in pool["rank"][steps == steps.min()])


def live_roots(
    roots: list[int], activity: pd.DataFrame, timeout_s: float, now_ns: int
) -> list[int]:
    """The wait graph's ``roots`` that are stuck in a run that says it is running (the module
    docstring): those whose watchdog said so, or every one where no rank was heard from for
    ``timeout_s`` (the tracer's hang timeout) before ``now_ns``: a job stopped without a word,
    its launcher gone too."""
    newest = pd.to_numeric(activity.last_ts_ns, errors="coerce").max()
    if pd.notna(newest) and now_ns - newest >= timeout_s * 1e9:
        return roots
    said = activity.has_hang_beat.fillna(False) | (activity.n_hang_stacks.fillna(0) > 0)
    stuck = set(activity["rank"][said.astype(bool)].astype(int))
    return [r for r in roots if r in stuck]


def detect(ctx: Context) -> list[Finding]:
    """The ``hang`` and ``crash`` findings of the module docstring."""
    status = ctx.run.meta.get("status")
    if status == "finished" and not ctx.unfinished:
        return []  # every rank finished every collective it started: nothing hung or died
    ctx.run.ensure_frontier()
    activity = ctx.run.query("findings/rank_activity")
    graph = graph_of(ctx, activity)
    missing_targets = {e.target for e in graph.edges if e.kind == "missing"}
    roots = list(graph.roots)
    if status == "finished":  # only a real disagreement counts (a Work never waited is not one)
        roots = [r for r in roots if r in missing_targets]
        if not roots:
            return []
    elif status == "running":
        timeout = (ctx.run.meta.get("tracer") or {}).get("hang_timeout_s")
        timeout = float(timeout or TracerConfig().hang_timeout_s)
        roots = live_roots(roots, activity, timeout, time.time_ns())
    alone = not roots
    if alone:
        said = bool((activity.has_hang_beat | (activity.n_hang_stacks > 0)).any())
        if status not in ("hung", "failed") and not said:
            return []
        roots = _stopped(activity)
        if not roots:
            return []
    crashed, hung = _classify(status, roots, graph, activity)
    out: list[Finding] = []
    if hung:
        out.append(_hang_finding(ctx, hung, graph, activity, alone))
    if crashed:
        out.append(_crash_finding(ctx, crashed, graph, activity))
    return out


def _classify(
    status: str | None, roots: list[int], graph: WaitGraph, activity: pd.DataFrame
) -> tuple[list[int], list[int]]:
    """(crashed, hung) culprits (see the module docstring, 3)."""
    if status != "failed":
        return [], sorted(roots)
    act = activity.set_index("rank")
    dead = {int(r) for r, row in act.iterrows() if not row.has_end and row.n_stacks == 0}
    crashed = sorted(dead & set(roots)) or sorted(r for r in dead if _behind(activity, r))
    crashed = sorted(set(crashed) | {r for r in dead if _behind(activity, r)})
    if not crashed:  # nobody died abruptly: ranks that stopped early crashed, others hang
        crashed = [r for r in roots if _behind(activity, r)]
        return crashed, [r for r in roots if r not in crashed]
    said_hang = {int(r) for r, row in act.iterrows() if row.has_hang_beat or row.n_hang_stacks > 0}
    hung = [r for r in roots if r not in crashed and r in said_hang and r in graph.heads]
    return crashed, hung


def _waits(graph: WaitGraph, ranks: list[int]) -> list[dict[str, Any]]:
    """The operations others wait in for ``ranks``, most waiters first."""
    by_op: dict[Any, list[Edge]] = defaultdict(list)
    for e in graph.waiters_of(ranks):
        by_op[(e.op.key if e.op else ("unrecorded", e.target))].append(e)
    waits = []
    for es in by_op.values():
        op = es[0].op
        waiting = sorted({e.waiter for e in es})
        missing = sorted({e.target for e in es})
        kinds = sorted({e.kind for e in es})
        w: dict[str, Any]
        if op is None:
            w = {"group": "pp", "channel": "pipeline transfer (not recorded)", "op": "send/recv",
                 "seq": None, "step": None}  # fmt: skip
        else:
            w = op.describe()
        w.update(waiting_ranks=waiting, missing_ranks=missing, kind="/".join(kinds))
        first = min((e.op.issue_ns for e in es if e.op is not None), default=0)
        waits.append((first, w))
    waits.sort(  # where the culprits are stuck with the others, then what they never
        key=lambda t: (  # entered (collectives first, the first wait that never ended first)
            t[1]["seq"] is None,
            "co-wait" not in t[1]["kind"],
            "->" in str(t[1]["channel"]),
            t[0],
            "missing" not in t[1]["kind"],
            -len(t[1]["waiting_ranks"]),
        )
    )
    return [w for _, w in waits]


def _victims(graph: WaitGraph, culprits: list[int]) -> list[dict[str, Any]]:
    """Every stuck rank that is not a culprit, grouped by the operation it is stuck in."""
    groups: dict[Any, dict[str, Any]] = {}
    waits_for: dict[int, set[int]] = defaultdict(set)  # in the operation it is stuck in
    for e in graph.edges:
        head = graph.victims.get(e.waiter)
        if (e.op is None and head is None) or (
            e.op is not None and head is not None and e.op.key == head.key
        ):
            waits_for[e.waiter].add(e.target)
    for rank, op in graph.victims.items():
        if rank in culprits:
            continue
        key = (op.channel.group, op.op, op.seq) if op else ("unrecorded",)
        g = groups.get(key)
        if g is None:
            if op is None:
                g = {"group": "pp", "op": "send/recv (not recorded)", "seq": None, "step": None}
            else:
                g = {"group": op.channel.group, "op": op.op, "seq": op.seq, "step": op.step}
            g.update(ranks=[], waiting_for=set())
            groups[key] = g
        g["ranks"].append(rank)
        g["waiting_for"] |= waits_for.get(rank, set())
    out = []
    for g in sorted(groups.values(), key=lambda g: -len(g["ranks"])):
        ranks = sorted(g["ranks"])
        g["count"] = len(ranks)
        g["ranks"] = ranks[:MAX_RANKS_LISTED]
        g["waiting_for"] = sorted(g["waiting_for"])[:MAX_RANKS_LISTED]
        out.append(g)
    return out[:MAX_LISTED]


def _who(ctx: Context, ranks: list[int]) -> str:
    if len(ranks) == 1:
        return ctx.label(ranks[0])
    return f"ranks {ranks}"


def _hang_finding(
    ctx: Context, ranks: list[int], graph: WaitGraph, activity: pd.DataFrame, alone: bool
) -> Finding:
    waits = _waits(graph, ranks)
    victims = _victims(graph, ranks)
    stacks = {str(r): s for r in ranks if (s := _stack(ctx, r)) is not None}
    last_steps = {str(r): _last_step(activity, r) for r in ranks}
    waiting = sorted({r for w in waits for r in w["waiting_ranks"]})
    n_victims = sum(v["count"] for v in victims)
    main: dict[str, Any] = waits[0] if waits else {}
    own = _own_state(graph, ranks)
    if not main and own:
        main = own[0]
    evidence = {
        "group": main.get("group"),
        "channel": main.get("channel"),
        "op": main.get("op"),
        "seq": main.get("seq"),
        "step": main.get("step"),
        "waiting_ranks": waiting,
        "waits": waits[:MAX_LISTED],
        "victims": victims,
        "n_victims": n_victims,
        "culprit_state": own[:MAX_LISTED],
        "last_step": last_steps,
        "stacks": stacks,
        "status": ctx.run.meta.get("status"),
        "basis": "no peers: the run stopped" if alone else "wait-for graph",
    }
    who = _who(ctx, ranks)
    them = "it" if len(ranks) == 1 else "them"
    if waits and main.get("seq") is not None:
        at = f" (step {main['step']})" if (main.get("step") or -1) >= 0 else ""
        where = f"{main['op']} seq {main['seq']} of {main['channel']}{at}"
        if "missing" not in main["kind"]:  # they entered it too: they stopped in it
            own_ = {o["rank"]: o for o in own}
            why = "; ".join(sorted({o["state"] for o in own_.values()})) or "entered by all"
            doing = f"stopped in {where} ({why})"
        elif main["op"] in ("send", "recv"):
            other = "recv" if main["op"] == "send" else "send"
            doing = f"never posted the {other} that matches {where}"
        else:
            doing = f"never entered {where}"
        msg = f"hang: {who} {doing}; {len(waiting)} ranks wait for {them}"
    elif waits:
        msg = f"hang: {who} stopped; {len(waiting)} ranks wait for {them} in pipeline transfers"
    elif own:
        o = own[0]
        msg = (
            f"hang: {who} never finished {o['op']} seq {o['seq']} of {o['channel']} ({o['state']})"
        )
    else:
        steps = sorted({s for s in last_steps.values() if s is not None})
        at = f" at step {steps[0]}" if steps else ""
        msg = f"hang: {who} stopped{at} (run {ctx.run.meta.get('status')})"
    if n_victims:
        msg += f"; {n_victims} ranks stuck behind {them} in all"
    if stacks:
        first = next(iter(stacks.values())).strip().splitlines()
        msg += f"; stack taken: {first[0].strip() if first else '?'}"
    step = main.get("step")
    if step is None or step < 0:
        known = [s for s in last_steps.values() if s is not None]
        step = max(known) if known else -1
    return finding(ctx, "hang", ranks, 1.0, msg, evidence, steps=[step, step])


def _own_state(graph: WaitGraph, ranks: list[int]) -> list[dict[str, Any]]:
    """What the culprits themselves are stuck in, if anything (a collective their peers
    finished; one every member entered and none finished)."""
    out = []
    for r in ranks:
        ops: list[tuple[Op, str]] = []
        alone = "it stopped enqueueing where its peers, stuck too, went on"
        if r in graph.stopped_alone and (r in graph.heads or r in graph.stale):
            first = graph.heads[r] if r in graph.heads else graph.stale[r][0]
            ops = [(first, alone)]
        elif r in graph.stale:
            ops = [(o, "its peers finished it") for o in graph.stale[r][:1]]
        elif r in graph.heads:
            h = graph.heads[r]
            state = "every member entered it"
            if any(e.kind == "co-wait" and e.target == r for e in graph.edges):
                started = any(graph.heads.get(e.waiter, h).started for e in graph.edges
                              if e.kind == "co-wait" and e.target == r)  # fmt: skip
                state += (
                    "; the others' kernels started, not its own"
                    if started and not h.started
                    else "; it stopped enqueueing before the others"
                )
            ops = [(h, state)]
        for o, state in ops:
            out.append({**o.describe(), "rank": r, "state": state})
    return out


def _crash_finding(
    ctx: Context, ranks: list[int], graph: WaitGraph, activity: pd.DataFrame
) -> Finding:
    waits = _waits(graph, ranks)
    last_steps = {str(r): _last_step(activity, r) for r in ranks}
    others = activity[~activity["rank"].isin(ranks)].last_step.max()
    victims = _victims(graph, ranks)
    evidence = {
        "last_step": last_steps,
        "others_last_step": None if pd.isna(others) else int(others),
        "status": ctx.run.meta.get("status"),
        "waits": waits[:MAX_LISTED],
        "waiting_ranks": sorted({r for w in waits for r in w["waiting_ranks"]}),
        "victims": victims,
        "n_victims": sum(v["count"] for v in victims),
    }
    who = _who(ctx, ranks)
    stop = [s for s in last_steps.values() if s is not None]
    msg = f"crash: {who} stopped reporting" + (f" (last record: step {max(stop)})" if stop else "")
    if waits:
        waiting = evidence["waiting_ranks"]
        msg += f"; {len(waiting)} ranks were left waiting in {waits[0]['op']} ({waits[0]['group']})"
    elif not pd.isna(others):
        msg += f" while the others went on to step {int(others)}"
    step = max(stop) if stop else ctx.hi
    return finding(ctx, "crash", ranks, 1.0, msg, evidence, steps=[step, step])


HANG = Kind("hang", culprit=True)
CRASH = Kind("crash", culprit=True)
# hang and crash read the same frontier of collectives: one detector emits both
DETECTOR = DetectorSpec("hang", detect, (HANG, CRASH))
