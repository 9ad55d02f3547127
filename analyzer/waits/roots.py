"""Who is at the root of a wait-for graph beyond its cycles (see
:mod:`analyzer.waits.graph`, step 6): strongly connected components, ranks that stopped
enqueueing on their own, and which waits the roots with records explain.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from analyzer.waits.model import NEVER, Channel, Edge, Member, Op


def stopped_unprompted(
    members: Mapping[Channel, Mapping[int, Member]], live_keys: Mapping[int, set]
) -> set[int]:
    """Step 6's ranks that stopped on their own: rank ``r`` whose last seq in a collective
    channel it shares with rank ``p`` is ``L``, while ``p`` never finished ``L`` (it was stuck
    by then) and went on past ``r``'s last seq in some channel they share. The members of a
    group run the same program, so a host sync (a wait for the device) where ``r`` stopped
    would have held ``p`` there too: ``r`` stopped enqueueing for a reason of its own (a dead
    GPU, a held GIL, a hung CPU), whatever its own operations wait for."""
    lasts: dict[int, dict[Channel, float]] = defaultdict(dict)
    for ch, ms in members.items():
        if ch.p2p:
            continue
        for r, m in ms.items():
            if m.last_seq > -NEVER:
                lasts[r][ch] = m.last_seq
    out: set[int] = set()
    for r, mine in lasts.items():
        stuck_at: set[int] = set()  # members stuck by the time they got where r stopped
        ahead: set[int] = set()  # members that went past where r stopped
        for ch, last in mine.items():
            for p, pm in members[ch].items():
                if p == r:
                    continue
                if (ch, int(last)) in live_keys.get(p, ()):
                    stuck_at.add(p)
                if pm.last_seq > last:
                    ahead.add(p)
        if stuck_at & ahead:
            out.add(r)
    return out


def lagging(members: Mapping[Channel, Mapping[int, Member]]) -> set[int]:
    """Ranks whose record stops before what their peers prove they did: a member of a
    collective channel finished a seq past the rank's last recorded one, which it could not
    have done without the rank. Such a record was taken before its rank got where it is
    now, and its rank took no later one while the job still ran: it froze where nothing of it
    runs (a held GIL, a wedged process), whatever its record last shows."""
    out: set[int] = set()
    for ch, ms in members.items():
        if ch.p2p:
            continue
        done = max((m.done_seq for m in ms.values()), default=-NEVER)
        out.update(r for r, m in ms.items() if -NEVER < m.last_seq < done)
    return out


def at_head(e: Edge, heads: Mapping[int, Op]) -> bool:
    """Whether ``e`` is a wait of its waiter where it is stuck (its head, or unseen)."""
    h = heads.get(e.waiter)
    return h is None or (e.op is not None and e.op.key == h.key)


def explained(roots: set[int], edges: list[Edge], heads: Mapping[int, Op]) -> set[int]:
    """``roots`` and every rank whose head waits, directly or through others, for one."""
    waits: dict[int, set[int]] = defaultdict(set)
    for e in edges:
        if at_head(e, heads):
            waits[e.waiter].add(e.target)
    out = set(roots)
    changed = True
    while changed:
        changed = False
        for w, targets in waits.items():
            if w not in out and targets & out:
                out.add(w)
                changed = True
    return out


def components(nodes: list[int], out: Mapping[int, set[int]]) -> dict[int, int]:
    """Strongly connected components (Tarjan, iterative): node -> component id."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    comp: dict[int, int] = {}
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(out.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(out.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp[w] = v
                    if w == v:
                        break
    return comp
