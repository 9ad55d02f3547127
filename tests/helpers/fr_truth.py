"""The culprits a simulated NCCL job's dumps can show, for jobs with more than one fault.

:func:`nccl_fr.write` counts a fault when its rank got to it. With two faults that is not
always something the dumps can tell: a rank whose GPU dies after it was already stuck behind
the other culprit, and whose CPU stopped where a healthy one would have waited anyway, leaves
the dumps of a victim. A fault is *evident* when its rank got to it and

* the rank was killed (it left no dump); or
* its GPU died inside the operation where its peers' GPUs wait for it (a collective every
  other member's GPU is in, a send/recv whose peer's GPU is at its side), and with timing
  (they started it, it did not), or else when it stopped enqueueing first (one of them
  enqueued more in a group they share); or
* without the fault (the same job, the other faults kept), the rank would have entered an
  operation that a peer did enter, and its stop is not a wait: it had nothing left to run
  (an idle GPU: a host sync would have returned), or that peer was already stuck when it
  got to where the rank stopped (it never ran its copy of the last collective the rank
  entered in some group they share). The members of a group sync with their device at the
  same places in its sequence (here after the last collective of an iteration): had the rank
  stopped at a host sync, the peer, stuck, would have stopped there too.

A fault nothing shows is no one's to find; the truth of a job is its evident faults, or the
faults its ranks got to when none is evident (one fault that nothing tells apart from its
peers').
"""

from __future__ import annotations

import dataclasses

from helpers import nccl_fr


def _key(work: dict) -> tuple[str, tuple[str, int]]:
    return work["group"], work["seq"]


def _posts(works: list[dict], direction: str, peer: int) -> int:
    return sum(1 for w in works if (direction, peer) in w["op"].peers)


def _lost_shows(actual: dict, without: dict, rank: int) -> bool:
    ranks = actual["ranks"]
    works = ranks[rank].works
    mine = {_key(w) for w in works}
    idle = not ranks[rank].queue
    groups = {g.name: g for gs in actual["groups"].values() for g in gs}
    last = {}  # group -> the seq of the last collective the rank entered there
    for w in works:
        if w["op"].kind == "coll":
            last[w["group"]] = w["seq"]
    stuck_at = set()  # peers stuck by the time they got to one of those
    for name, seq in last.items():
        for p in groups[name].ranks:
            if p == rank or p not in ranks:
                continue
            at = next((i for i, pw in enumerate(ranks[p].works) if _key(pw) == (name, seq)), None)
            if at is not None and any(i <= at for i in ranks[p].queue):
                stuck_at.add(p)
    done_before: list[dict] = []
    for w in without["ranks"][rank].works:
        done_before.append(w)
        if _key(w) in mine:
            continue
        op = w["op"]
        if op.kind != "coll":  # a send/recv: the peer posted its side
            if not idle:
                continue
            for direction, peer in op.peers:
                other = "recv" if direction == "send" else "send"
                n = _posts(done_before, direction, peer)
                if peer in ranks and _posts(ranks[peer].works, other, rank) >= n:
                    return True
            continue
        for p in groups[w["group"]].ranks:
            entered = p != rank and any(_key(pw) == _key(w) for pw in ranks[p].works)
            if entered and (idle or p in stuck_at):
                return True
    return False


def _died_in_it(job: nccl_fr.Job, actual: dict, fault: nccl_fr.Fault) -> bool:
    """Its GPU died inside the operation its peers' GPUs wait in, and that shows (see the
    module docstring)."""
    if fault.kind != "dead_gpu":
        return False
    ranks = actual["ranks"]
    r = ranks[fault.rank]
    if not r.queue:
        return False
    head = r.works[r.queue[0]]
    if head["index"] != nccl_fr._fault_index(job, fault.rank, fault):
        return False

    def at_head(p: int, matches) -> bool:  # p's live GPU has the matching operation first
        q = ranks[p]
        if not q.queue:
            return False
        w = q.works[q.queue[0]]
        return matches(w) and actual["stop_gpu"].get(p, 1 << 60) > w["index"]

    if head["op"].kind != "coll":  # a send/recv: every peer's GPU is at its side
        peers = [p for _, p in head["op"].peers]
        there = all(at_head(p, _sides(d, fault.rank)) for d, p in head["op"].peers)
    else:
        group = next(g for gs in actual["groups"].values() for g in gs if g.name == head["group"])
        peers = [p for p in group.ranks if p != fault.rank]
        there = all(at_head(p, lambda w: _key(w) == _key(head)) for p in peers)
    if not there:
        return False
    if job.timing:
        return True

    def count(rank: int, name: str) -> int:
        return sum(1 for w in ranks[rank].works if w["group"] == name)

    shared = [g for gs in actual["groups"].values() for g in gs if fault.rank in g.ranks]
    return any(  # a peer enqueued more than it in some group they share
        count(p, g.name) > count(fault.rank, g.name) for p in peers for g in shared if p in g.ranks
    )


def _sides(direction: str, rank: int):
    """Whether a work is the other side of ``rank``'s send or recv (``direction``)."""
    other = "recv" if direction == "send" else "send"
    return lambda w: (other, rank) in w["op"].peers


def evident(job: nccl_fr.Job) -> list[int]:
    """The job's truth (see the module docstring)."""
    reached: set[int] = set()
    actual: dict = {}
    nccl_fr.simulate(job, reached, actual)
    out = set()
    for f in job.faults:
        if f.rank not in reached:
            continue
        if f.kind == "killed" or _died_in_it(job, actual, f):
            out.add(f.rank)
            continue
        without: dict = {}
        rest = tuple(x for x in job.faults if x != f)
        nccl_fr.simulate(dataclasses.replace(job, faults=rest), None, without)
        if _lost_shows(actual, without, f.rank):
            out.add(f.rank)
    return sorted(out) or sorted(reached)


def write(job: nccl_fr.Job, out: str, compress: bool = True) -> list[int]:
    """:func:`nccl_fr.write`, with the evident culprits as ``Fault ranks`` (returned)."""
    nccl_fr.write(job, out, compress)
    truth = evident(job)
    path = f"{out}/fault_injection.log"
    with open(path) as f:
        lines = f.read().splitlines()
    lines[0] = f"Fault ranks: {truth}"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return truth
