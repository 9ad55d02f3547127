"""The wait-for graph of a run that stopped: who waits in what, for whom, and who is at the root.

Input: the channel frontier (``findings/channel_frontier.sql``): for every channel (one process
group instance, or one direction of a send/recv pair) and every member, the last seq the member
entered, the last it finished, the first it recorded, and its unfinished rows; and per rank its
activity (``findings/rank_activity.sql``).

1. A collective (channel, seq) is *complete* when every member entered it and some member
   finished it, or recorded only seqs after it (a ring buffer, or a dump of the active entries
   only, keeps none of the ones already done). (A member that never entered it makes another's
   end a failure: gloo retires a work that failed.) An unfinished row of a complete collective
   is *stale*: the rank never saw the end of something its peers finished (a dead GPU; a
   watchdog that cannot look).
2. A rank's *live* operations are its unfinished rows of incomplete collectives, in the order
   it issued them; the first is its *head*, where it is stuck.
3. Edges, from each live operation of rank ``r`` in channel ``c`` at ``seq``, to each member
   ``m`` of ``c``: ``missing`` when ``m`` never entered ``seq`` (its last seq there is lower, or
   it has no record); and from ``r``'s head only, ``busy`` when ``m`` entered it but is stuck
   in an earlier operation of its own (``m``'s head is elsewhere: queued work cannot run
   behind a stuck one). Later operations of ``r`` cannot be what holds ``r`` now, but a rank
   that never entered them is behind ``r``: a GPU that died inside a collective every member
   entered shows as the rank whose CPU stopped enqueueing first.
4. ``co-wait``: ranks stuck together in a collective every member entered (none finished it,
   none is stuck elsewhere) wait for the members of it that show they stopped: whose device
   never started it while the others' did (NCCL with timing), else whom others wait for in a
   later operation (their CPU stopped enqueueing first).
5. ``unrecorded``: waits the data does not hold. A pipeline's send/recv are not in gloo's
   Flight Recorder, so a stage stuck in one looks idle; and a dump taken before its rank
   entered its last operation does not show it. An idle rank that someone waits for, or that
   is next to a rank that left no record at all, waits for a neighbour that is stuck, waits
   itself or left no record; failing those (and only if someone waits for it), for one that
   idles too but was waited for first (the first wait that never ended marks where the job
   stopped); never for one that waits for it. Neighbours: the adjacent pipeline stages, when
   the run has pipeline groups and no send/recv row at all; any group-mate that left no record.
6. The culprits are the *roots*: ranks in a strongly connected component with no edge leaving
   it that someone waits for, or that hold stale rows. Ranks that only co-wait in a collective
   every member entered, with nothing to tell them apart, are roots only when nothing else is.
   A rank that *stopped on its own* is a root whatever its own operations wait for: one that
   shares a collective group with a rank that was stuck by the time it got to where this one
   stopped (it never finished its copy of this one's last seq there) and went on past it.
   The members of a group run the same program, so a host sync there would have held both:
   this one stopped enqueueing for a reason of its own (a dead GPU, a held GIL); on gloo,
   whose collectives hold the CPU, not when its last one waits for a member that never came
   (it is held there). So is a rank whose record stops before what its peers prove it did (a
   member finished a later seq of a collective they share): its record was taken before it got
   where it is, and it took none later while the job still ran, so nothing of it runs (a held
   GIL, a wedged process); an idle neighbour waits for it, unseen, as for one that is stuck.
   Two culprits in different groups are both found so: the second one's
   operations wait, behind the first one, like a victim's, but its stuck peers went on where
   it stopped. Whoever else is in its cycle waits for it. A rank that left no record is a root only when someone is stuck
   waiting for it and for no root with records (a lost dump is no culprit; a killed rank is).
   Everybody else who is stuck is a *victim*, grouped by the operation it is stuck in.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from analyzer.waits.model import NEVER, Channel, Edge, Member, Op
from analyzer.waits.roots import (
    at_head,
    components,
    explained,
    lagging,
    stopped_unprompted,
)

Members = dict[Channel, dict[int, Member]]  # channel -> member -> what it recorded there
Opens = dict[int, dict[tuple[Channel, int], Op]]  # rank -> its unfinished operations


@dataclass
class WaitGraph:
    """The result of :func:`build`."""

    roots: list[int]
    victims: dict[int, Op | None]  # victim -> the operation it is stuck in (None: unrecorded)
    edges: list[Edge]
    heads: dict[int, Op]
    stale: dict[int, list[Op]]
    co_waiting: list[int]  # roots that only co-wait in a collective every member entered
    stopped_alone: list[int] = field(default_factory=list)  # roots that stopped on their own
    waited_since: dict[int, float] = field(default_factory=dict)

    @property
    def waiting(self) -> bool:
        """Whether any rank waits: an edge between ranks, a stale operation, or a rank with an
        unfinished operation."""
        return bool(self.edges or self.stale or self.heads)

    def waiters_of(self, ranks: Iterable[int]) -> list[Edge]:
        """The edges that end in ``ranks`` from ranks outside them."""
        rs = set(ranks)
        return [e for e in self.edges if e.target in rs and e.waiter not in rs]


def _num(v: Any, default: float) -> float:
    return (
        default if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else float(v)
    )


def _rows(value: Any) -> list[Mapping[str, Any]]:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return []
    return list(value)


def build(
    frontier: pd.DataFrame,
    pipelines: Mapping[int, list[int]] | None = None,
    silent: Iterable[int] = (),
    blocking: bool = False,
) -> WaitGraph:
    """The wait-for graph of the module docstring.

    ``blocking``: collectives hold the CPU until they complete (gloo), so a rank whose last
    operation waits for a member that never entered it stopped there, not on its own.

    ``frontier``: rows of ``findings/channel_frontier``. ``pipelines``: rank -> its pipeline
    neighbours (adjacent stages), used only when the data holds no send/recv at all.
    ``silent``: ranks that left no record at all (a dump never written): they count as the
    first to stop, for step 5.
    """
    members, opens = _read(frontier)
    live, stale = _live_and_stale(members, opens)  # steps 1 and 2
    heads = {r: ops[0] for r, ops in live.items()}
    live_keys = {r: {o.key for o in ops} for r, ops in live.items()}
    edges = _recorded_waits(live, heads, live_keys, members)  # step 3
    edges += _co_waits(edges, heads, members)  # step 4

    waited_since: dict[int, float] = {r: -NEVER for r in silent}
    for e in edges:
        if e.kind == "missing" and e.op is not None:
            waited_since[e.target] = min(waited_since.get(e.target, NEVER), e.op.issue_ns)

    quiet = set(silent)
    frozen = lagging(members)
    nearby = _nearby(members, pipelines, quiet)
    edges += _unrecorded(edges, nearby, set(live) | set(stale) | frozen, quiet, waited_since)

    nodes: set[int] = set(live) | set(stale)  # step 6
    for e in edges:
        nodes.update((e.waiter, e.target))
    self_stopped = _self_stopped(members, live_keys, opens, edges, blocking)
    self_stopped |= frozen & nodes
    roots, co_wait = _roots(nodes, edges, self_stopped, live, stale)
    unseen = set(roots) & quiet
    if unseen and len(unseen) < len(roots):  # a lost dump, or a rank that died too?
        known = explained(set(roots) - quiet, edges, heads)
        needed = {e.target for e in edges if e.waiter not in known and at_head(e, heads)}
        roots = [r for r in roots if r not in quiet or r in needed]
        nodes -= unseen - set(roots)
    return WaitGraph(
        roots=roots,
        victims=_victims(nodes, roots, heads, stale),
        edges=edges,
        heads=heads,
        stale=stale,
        co_waiting=sorted(co_wait),
        stopped_alone=sorted(self_stopped & set(roots)),
        waited_since=waited_since,
    )


def _read(frontier: pd.DataFrame) -> tuple[Members, Opens]:
    """Each channel's members and what they recorded there; each rank's unfinished
    operations (one per channel and seq, a started copy preferred)."""
    members: Members = defaultdict(dict)
    opens: Opens = defaultdict(dict)
    for row in frontier.itertuples(index=False):
        ch = Channel(str(row.group), int(row.gid), int(row.src), int(row.dst))
        rank = int(row.rank)
        members[ch][rank] = Member(
            last_seq=_num(row.last_seq, -NEVER),
            done_seq=_num(row.done_seq, -NEVER),
            min_seq=_num(row.min_seq, NEVER),
        )
        for o in _rows(row.open_rows):
            op = Op(
                ch,
                int(o["seq"]),
                str(o["op"]),
                int(_num(o["step"], -1)),
                int(_num(o["issue_ns"], 0)),
                bool(o.get("started") or False),
            )
            if op.key not in opens[rank] or op.started:
                opens[rank][op.key] = op
    return members, opens


def _live_and_stale(
    members: Members, opens: Opens
) -> tuple[dict[int, list[Op]], dict[int, list[Op]]]:
    """Steps 1 and 2: each rank's live operations in the order it issued them, and the
    unfinished rows of the ranks that have only stale ones."""
    done_upto = {
        ch: max((m.done_seq for m in ms.values()), default=-NEVER) for ch, ms in members.items()
    }
    first_after = {  # a member whose records begin above seq passed seq
        ch: max((m.min_seq for m in ms.values() if m.min_seq < NEVER), default=-NEVER)
        for ch, ms in members.items()
    }

    all_entered = {ch: min(m.last_seq for m in ms.values()) for ch, ms in members.items()}

    def complete(ch: Channel, seq: int) -> bool:
        # no collective completes without every member; gloo retires a failed one too
        return (seq <= done_upto[ch] or seq < first_after[ch]) and seq <= all_entered[ch]

    live: dict[int, list[Op]] = {}
    stale: dict[int, list[Op]] = {}
    for rank, ops in opens.items():
        mine = sorted(ops.values(), key=lambda o: (o.issue_ns, o.seq))
        alive = [o for o in mine if not complete(o.channel, o.seq)]
        if alive:
            live[rank] = alive
        elif mine:
            stale[rank] = mine
    return live, stale


def _recorded_waits(
    live: Mapping[int, list[Op]],
    heads: Mapping[int, Op],
    live_keys: Mapping[int, set[tuple[Channel, int]]],
    members: Members,
) -> list[Edge]:
    """Step 3: the ``missing`` and ``busy`` edges of every live operation."""
    edges: list[Edge] = []
    for r, ops in live.items():
        for o in ops:
            ch = o.channel
            for m, state in members[ch].items():
                if m == r:
                    continue
                if state.last_seq < o.seq:
                    edges.append(Edge(r, m, o, "missing"))
                elif o is ops[0] and o.key in live_keys.get(m, ()) and heads[m].key != o.key:
                    edges.append(Edge(r, m, o, "busy"))
    return edges


def _nearby(
    members: Members, pipelines: Mapping[int, list[int]] | None, silent: set[int]
) -> dict[int, set[int]]:
    """Step 5's neighbours: idle rank -> whom it may wait for unseen."""
    p2p_recorded = any(ch.p2p for ch in members)
    nearby: dict[int, set[int]] = defaultdict(set)
    if pipelines and not p2p_recorded:
        for r, ns in pipelines.items():
            nearby[r].update(ns)
    for ms in members.values():  # a group-mate that left no record at all
        for s_ in silent & set(ms):
            for m in ms:
                nearby[m].add(s_)
    return nearby


def _self_stopped(
    members: Members,
    live_keys: Mapping[int, set[tuple[Channel, int]]],
    opens: Opens,
    edges: list[Edge],
    blocking: bool,
) -> set[int]:
    """Step 6's ranks that stopped on their own (on gloo, not those held in their last
    collective by a member that never came)."""
    self_stopped = stopped_unprompted(members, live_keys)
    if blocking:
        for r in list(self_stopped):
            last = max(opens.get(r, {}).values(), key=lambda o: (o.issue_ns, o.seq), default=None)
            if any(e.waiter == r and e.op == last and e.kind == "missing" for e in edges):
                self_stopped.discard(r)
    return self_stopped


def _roots(
    nodes: set[int],
    edges: list[Edge],
    self_stopped: set[int],
    live: Mapping[int, list[Op]],
    stale: Mapping[int, list[Op]],
) -> tuple[list[int], list[int]]:
    """Step 6: the roots (sorted), and the ranks that only co-wait when they are the roots."""
    targets = {e.target for e in edges}
    out: dict[int, set[int]] = defaultdict(set)
    for e in edges:
        out[e.waiter].add(e.target)
    comp = components(sorted(nodes), out)
    leaving: dict[int, bool] = defaultdict(bool)
    for a, bs in out.items():
        for b in bs:
            if comp[a] != comp[b]:
                leaving[comp[a]] = True
    by_comp: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        by_comp[comp[n]].append(n)
    roots: list[int] = []
    co_wait: list[int] = []
    for c, ranks in by_comp.items():
        own = [r for r in ranks if r in self_stopped]
        if own:  # whoever else is in its cycle waits for it
            roots += own
        elif leaving[c]:
            continue
        elif any(r in targets or r in stale for r in ranks):
            roots += ranks
        elif any(r in live for r in ranks):
            co_wait += ranks
    if not roots:
        roots, co_wait = co_wait, co_wait
    else:
        co_wait = []
    return sorted(set(roots)), co_wait


def _victims(
    nodes: set[int], roots: list[int], heads: Mapping[int, Op], stale: Mapping[int, list[Op]]
) -> dict[int, Op | None]:
    """Everybody else stuck, with the operation it is stuck in (None: unrecorded)."""
    victims: dict[int, Op | None] = {}
    for n in sorted(nodes - set(roots)):
        if n in heads:
            victims[n] = heads[n]
        elif n in stale:
            victims[n] = stale[n][0]
        else:
            victims[n] = None
    return victims


def _co_waits(
    edges: list[Edge], heads: Mapping[int, Op], members: Mapping[Channel, Mapping[int, Member]]
) -> list[Edge]:
    """Ranks stuck in a collective every member entered wait for the members of it that show
    they stopped: that others wait for elsewhere (they stopped enqueueing first), or whose
    device never started it while the others' did."""
    blocked = {e.waiter for e in edges if e.op is not None and e.op.key == heads[e.waiter].key}
    wanted = {e.target for e in edges if e.kind == "missing"}
    by_op: dict[tuple[Channel, int], list[int]] = defaultdict(list)
    for r, h in heads.items():
        if r not in blocked:
            by_op[h.key].append(r)
    out = []
    for (ch, _seq), ranks in by_op.items():
        if set(ranks) != set(members[ch]):
            continue  # some member is elsewhere: that is an edge already, or data is missing
        started = {r for r in ranks if heads[r].started}
        if started and len(started) < len(ranks):  # the device says who never got there
            suspects = set(ranks) - started
        else:
            suspects = {r for r in ranks if r in wanted}
        if not suspects or len(suspects) == len(ranks):
            continue
        for r in sorted(set(ranks) - suspects):
            out += [Edge(r, m, heads[r], "co-wait") for m in sorted(suspects)]
    return out


def _unrecorded(
    edges: list[Edge],
    nearby: Mapping[int, set[int]],
    stuck: set[int],
    silent: set[int],
    waited_since: Mapping[int, float],
) -> list[Edge]:
    """Step 4 of the module docstring, to a fixed point. An idle rank that someone waits for,
    or next to one that left no record, waits, unseen, for a neighbour that is stuck, waits
    itself or left no record; failing those (and only if someone waits for it), for one that
    idles too but was waited for first; never for one that waits for it."""
    pairs = {(e.waiter, e.target) for e in edges}
    waiting = {e.waiter for e in edges}
    targets = {e.target for e in edges}
    added: list[Edge] = []

    def add(r: int, n: int) -> None:
        added.append(Edge(r, n, None, "unrecorded"))
        pairs.add((r, n))
        waiting.add(r)
        targets.add(n)

    near_silent = {r for r, ns in nearby.items() if ns & silent}
    changed = True
    while changed:
        changed = False
        for r in sorted((targets | near_silent) - stuck - silent):
            for n in sorted(nearby.get(r, ())):
                if n == r or (r, n) in pairs or (n, r) in pairs:
                    continue
                if n in stuck or n in waiting or n in silent:
                    add(r, n)
                    changed = True
        if changed:
            continue
        for r in sorted(targets - stuck - silent - waiting):
            for n in sorted(nearby.get(r, ())):
                if n == r or (n, r) in pairs:
                    continue
                if waited_since.get(n, NEVER) < waited_since.get(r, NEVER):
                    add(r, n)
                    changed = True
    return added


def pipeline_neighbours(group_members: pd.DataFrame) -> dict[int, list[int]]:
    """rank -> its adjacent stages, from the ``pp`` groups of ``group_members``."""
    out: dict[int, list[int]] = defaultdict(list)
    pp = group_members[group_members["group"] == "pp"]
    for _, g in pp.groupby("gid"):
        ranks = sorted(int(r) for r in g["rank"])
        for i, r in enumerate(ranks):
            out[r] += [ranks[j] for j in (i - 1, i + 1) if 0 <= j < len(ranks)]
    return dict(out)
