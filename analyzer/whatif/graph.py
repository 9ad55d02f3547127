"""The dependency graph of one step, built from the run's own rows (the template step).

Operations (*slots*) are a rank's compute spans and its collective rows. A compute span that
holds collectives of its own rank (a forward whose tensor-parallel all-gathers the tracer saw
inside it) is cut into pieces around them, so that a piece computes and the collective waits;
this is done on ranks whose spans do not overlap (one stream; a multi-stream device trace keeps
its spans whole).

Dependencies, all read from the template's times:

* on its rank, an operation starts after the operation that last finished before it started
  (``pred``: the op order of the rank, with the real ordering of overlapping work), and, when it
  started while an earlier operation was still running (a non-blocking send, an async
  reduce-scatter, a kernel on another stream), at the same fraction of that operation
  (``cont``, ``frac``: 0 for an op posted as the other was posted);
* the members of a collective (``group``) all end together: at the last member's arrival plus
  the transfer; a send and its receive are a group of two (matched by sender, receiver and
  sequence number); collectives match by group, group instance (from run.json's groups) and
  sequence number;
* every step starts from zero on every rank (step boundaries); the step ends with its last
  operation. Pipeline schedules (1F1B, interleaved) need no model of their own: their order is
  the ranks' recorded order, and their waits are the send/recv pairs.

Nodes for the replay: one per slot (a compute slot's start and end; a collective member's
arrival) and one per group (its end). ``levels`` orders them so that a node only reads nodes of
earlier levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzer.whatif.load import Template, WhatIfError

EPS = 1e-9  # seconds: an op that ends this close after another starts still counts as before it
NEAR = 50e-6  # seconds: a collective ending this close after an op starts counts as before it


@dataclass
class Slots:
    """The template's operations after cutting spans, in rank order."""

    rank: np.ndarray  # int64
    cls: np.ndarray  # int8: 0 compute, 1 collective, 2 send, 3 recv
    a: np.ndarray  # template row whose time starts the slot (a compute piece) / its row
    a_end: np.ndarray  # bool: the start is that row's end (t1) rather than its start (t0)
    b: np.ndarray  # template row whose time ends the slot
    b_end: np.ndarray  # bool: the end is that row's t1
    key: np.ndarray  # int64: which slots are peers (same op, same piece, same size)
    keys: list[str]  # key -> its text
    op: np.ndarray  # int64: the op kind for attribution (by_op)
    ops: list[str]  # op kind -> its text

    def __len__(self) -> int:
        return len(self.rank)

    def times(self, t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A slot's start and end in every step from the template rows' ``t0``/``t1``
        (``(rows,)`` or ``(rows, steps)``)."""
        start = np.where(_col(self.a_end, t0), t1[self.a], t0[self.a])
        end = np.where(_col(self.b_end, t0), t1[self.b], t0[self.b])
        return start, end


def _col(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    return mask if like.ndim == 1 else mask[:, None]


@dataclass
class Graph:
    """The dependency graph of the template step (the module docstring): per slot its ``pred``,
    ``cont``/``frac`` and collective ``group``, and the replay's ``levels``."""

    slots: Slots
    pred: np.ndarray  # int64 slot, -1: none
    cont: np.ndarray  # int64 slot, -1: none
    frac: np.ndarray  # float64
    group: np.ndarray  # int64 group of a collective slot, -1 for compute
    n_groups: int
    levels: list[tuple[np.ndarray, np.ndarray]]  # (slot nodes, group nodes) per level
    members: np.ndarray  # slots sorted by group
    member_start: np.ndarray  # members[member_start[g]:member_start[g + 1]] are g's


def cut_spans(tpl: Template) -> Slots:
    """Slots of the template: spans cut around the collectives they hold (single-stream ranks)."""
    n = len(tpl)
    idx = np.arange(n)
    is_span = tpl.cls == 0
    new_rank = np.r_[True, tpl.rank[1:] != tpl.rank[:-1]] if n else np.zeros(0, bool)
    # the last span at or before each row, on the same rank
    last_span = np.where(is_span, idx, -1)
    seg = np.cumsum(new_rank) - 1
    last_span = _segmented_max(last_span, seg)
    single = _single_stream_ranks(tpl, is_span)
    inside = (
        ~is_span
        & (last_span >= 0)
        & single[seg]
        & (tpl.t1 <= tpl.t1[np.maximum(last_span, 0)] + EPS)
    )
    host = np.where(inside, last_span, -1)
    # pieces: before each inside collective one, and each span's last piece at its own place
    prev_inside = _prev_inside(host, inside, idx)
    n_in = np.bincount(host[inside], minlength=n) if n else np.zeros(0, int)
    j_of = _rank_within(host, inside)
    last_in = np.full(n, -1)
    if inside.any():
        h = host[inside]
        first = _starts(h)
        last_in[h[first]] = np.maximum.reduceat(idx[inside], first)
    rows = []
    # 1. a piece before every inside collective
    ins = idx[inside]
    pa = np.where(prev_inside[ins] >= 0, prev_inside[ins], host[ins])
    rows.append(dict(order=ins - 0.5, rank=tpl.rank[ins], cls=np.zeros(len(ins), np.int8),
                     a=pa, a_end=prev_inside[ins] >= 0, b=ins, b_end=np.zeros(len(ins), bool),
                     src=host[ins], piece=j_of[ins], pieces=n_in[host[ins]] + 1))  # fmt: skip
    # 2. every span's last piece (the whole span when it holds nothing)
    sp = idx[is_span]
    la = last_in[sp]
    rows.append(dict(order=np.where(la >= 0, la + 0.5, sp).astype(float), rank=tpl.rank[sp],
                     cls=np.zeros(len(sp), np.int8), a=np.where(la >= 0, la, sp), a_end=la >= 0,
                     b=sp, b_end=np.ones(len(sp), bool), src=sp, piece=n_in[sp],
                     pieces=n_in[sp] + 1))  # fmt: skip
    # 3. the collectives themselves
    co = idx[~is_span]
    rows.append(dict(order=co.astype(float), rank=tpl.rank[co], cls=tpl.cls[co], a=co,
                     a_end=np.zeros(len(co), bool), b=co, b_end=np.ones(len(co), bool), src=co,
                     piece=np.zeros(len(co), int), pieces=np.ones(len(co), int)))  # fmt: skip
    cols = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    order = np.lexsort((cols["order"], cols["rank"]))
    cols = {k: v[order] for k, v in cols.items()}
    key_text, op_text = _labels(tpl, cols)
    key, keys = pd.factorize(pd.Series(key_text), sort=True)
    op, ops = pd.factorize(pd.Series(op_text), sort=True)
    return Slots(
        rank=cols["rank"].astype(np.int64), cls=cols["cls"].astype(np.int8),
        a=cols["a"].astype(np.int64), a_end=cols["a_end"].astype(bool),
        b=cols["b"].astype(np.int64), b_end=cols["b_end"].astype(bool),
        key=key.astype(np.int64), keys=[str(k) for k in keys],
        op=op.astype(np.int64), ops=[str(o) for o in ops],
    )  # fmt: skip


def _labels(tpl: Template, cols: dict) -> tuple[np.ndarray, np.ndarray]:
    src = cols["src"]
    label = tpl.label[src].astype(str)
    grp = tpl.grp[src].astype(str)
    cls = cols["cls"]
    compute = cls == 0
    piece = np.char.add(
        np.char.add("#", cols["piece"].astype(str)), np.char.add("/", cols["pieces"].astype(str))
    )
    coll_key = np.char.add(
        np.char.add(np.char.add(label, " "), grp), np.char.add(" ", tpl.nbytes[src].astype(str))
    )
    key = np.where(compute, np.char.add(label, piece), coll_key)
    p2p = (cls == 2) | (cls == 3)
    op = np.where(
        compute,
        label,
        np.where(p2p, np.char.add("send/recv ", grp), np.char.add(np.char.add(label, " "), grp)),
    )
    return key, op


def _segmented_max(values: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Running maximum of ``values`` that restarts at each new ``seg`` (sorted segments)."""
    if not len(values):
        return values
    shift = seg.astype(np.int64) * (len(values) + 2)
    return np.maximum.accumulate(values + 1 + shift) - shift - 1


def _single_stream_ranks(tpl: Template, is_span: np.ndarray) -> np.ndarray:
    """Per rank segment: whether its spans never overlap each other."""
    n = len(tpl)
    new_rank = np.r_[True, tpl.rank[1:] != tpl.rank[:-1]] if n else np.zeros(0, bool)
    n_seg = int(new_rank.sum())
    seg = np.cumsum(new_rank) - 1
    ok = np.ones(n_seg, dtype=bool)
    s = np.flatnonzero(is_span)
    if len(s) > 1:
        same = tpl.rank[s[1:]] == tpl.rank[s[:-1]]
        overlap = same & (tpl.t0[s[1:]] < tpl.t1[s[:-1]] - 1e-6)
        ok[seg[s[1:]][overlap]] = False
    return ok


def _starts(sorted_keys: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])


def _prev_inside(host: np.ndarray, inside: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """For each inside collective, the previous inside collective of the same span (-1)."""
    out = np.full(len(host), -1)
    ins = idx[inside]
    if len(ins) > 1:
        same = host[ins[1:]] == host[ins[:-1]]
        out[ins[1:][same]] = ins[:-1][same]
    return out


def _rank_within(host: np.ndarray, inside: np.ndarray) -> np.ndarray:
    """Position (0, 1, ...) of each inside collective among those of its span."""
    out = np.zeros(len(host), dtype=np.int64)
    ins = np.flatnonzero(inside)
    if len(ins):
        h = host[ins]
        first = _starts(h)
        counts = np.diff(np.r_[first, len(h)])
        out[ins] = np.arange(len(h)) - np.repeat(first, counts)
    return out


def build_graph(tpl: Template, meta: dict) -> Graph:
    """The dependency graph of the template step (see the module docstring)."""
    slots = cut_spans(tpl)
    start, end = slots.times(tpl.t0, tpl.t1)
    pred, cont, frac = _rank_deps(slots.rank, start, end, slots.cls > 0)
    group, n_groups = _groups(tpl, slots, meta)
    members = np.argsort(group, kind="stable")
    members = members[group[members] >= 0]
    member_start = np.searchsorted(group[members], np.arange(n_groups + 1))
    levels = _levels(len(slots), pred, cont, frac, group, n_groups, members, member_start)
    return Graph(slots, pred, cont, frac, group, n_groups, levels, members, member_start)


def graph_from_arrays(
    rank: np.ndarray,
    pred: np.ndarray,
    group: np.ndarray,
    levels: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> Graph:
    """A graph given directly rather than read from a template (the simulator's): each slot's
    rank, its predecessor on the rank (-1: none) and its group (-1: compute; groups numbered
    from 0). No ``cont`` dependencies. ``levels`` (None: computed) when the caller knows them;
    the slots carry no template rows or labels."""
    n = len(rank)
    idx = np.arange(n, dtype=np.int64)
    cont, frac = np.full(n, -1, dtype=np.int64), np.zeros(n)
    n_groups = int(group.max()) + 1 if n else 0
    members = np.argsort(group, kind="stable")
    members = members[group[members] >= 0]
    member_start = np.searchsorted(group[members], np.arange(n_groups + 1))
    if levels is None:
        levels = _levels(n, pred, cont, frac, group, n_groups, members, member_start)
    none, no = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
    slots = Slots(rank=rank, cls=(group >= 0).astype(np.int8), a=idx, a_end=none, b=idx,
                  b_end=none, key=no, keys=[""], op=no, ops=[""])  # fmt: skip
    return Graph(slots, pred, cont, frac, group, n_groups, levels, members, member_start)


def _rank_deps(rank: np.ndarray, t0: np.ndarray, t1: np.ndarray, comm: np.ndarray):
    """``pred``, ``cont`` and ``frac`` of every slot (see the module docstring).

    A collective still in flight when an op starts (a non-blocking send, a batched send and
    receive) only gives its posting time (``frac`` 0): the op did not wait for it. One that ends
    within ``NEAR`` of the start (clock jitter between a receive's end and the compute it feeds)
    counts as finished before it."""
    n = len(rank)
    idx = np.arange(n)
    if not n:
        return idx, idx, np.zeros(0)
    lo, hi = float(min(t0.min(), 0.0)), float(max(t1.max(), 0.0))
    width = hi - lo + 1.0
    base = (rank - rank.min()).astype(np.float64) * width - lo
    # pred: the slot of the rank with the latest end <= my start, earlier than me in order
    by_end = np.lexsort((idx, t1 + base))
    ends = (t1 + base)[by_end]
    pos = np.searchsorted(ends, t0 + base + EPS, side="right") - 1
    pred = np.full(n, -1)
    todo = idx.copy()
    for _ in range(8):  # step back over later slots that ended as early (zero-length ones)
        ok = pos[todo] >= 0
        cand = np.where(ok, by_end[np.maximum(pos[todo], 0)], -1)
        good = ok & (cand < todo) & (rank[np.maximum(cand, 0)] == rank[todo])
        pred[todo[good]] = cand[good]
        retry = ok & ~good & (cand >= todo) & (rank[np.maximum(cand, 0)] == rank[todo])
        pos[todo[retry]] -= 1
        todo = todo[retry]
        if not len(todo):
            break
    # cont: the earlier slot of the rank still running when I start (the latest-ending one)
    new = np.r_[True, rank[1:] != rank[:-1]]
    seg = np.cumsum(new) - 1
    key = t1 + base
    run = np.maximum.accumulate(key)
    at = np.where(key == run, idx, 0)
    at = np.maximum.accumulate(at)
    prev_at = np.r_[-1, at[:-1]]
    prev_at[new] = -1
    cont = np.full(n, -1)
    has = prev_at >= 0
    running = has & (t1[np.maximum(prev_at, 0)] > t0 + EPS)
    running &= seg[np.maximum(prev_at, 0)] == seg
    cont[running] = prev_at[running]
    c = cont[running]
    dur = t1[c] - t0[c]
    near = comm[c] & (t1[c] - t0[running] <= np.minimum(NEAR, 0.01 * dur))
    r_near = np.flatnonzero(running)[near]
    pred[r_near] = c[near]  # the latest-ending earlier op: finished, for all that matters
    cont[r_near] = -1
    running[r_near] = False
    c = cont[running]
    dur = t1[c] - t0[c]
    frac = np.zeros(n)
    f = np.where(dur > 0, (t0[running] - t0[c]) / np.where(dur > 0, dur, 1.0), 0.0)
    frac[running] = np.where(comm[c], 0.0, np.clip(f, 0.0, 1.0))
    return pred, cont, frac


def _group_instance(meta: dict, names: list[str], ranks_max: int) -> dict[str, np.ndarray]:
    """For each group name, each rank's instance of it (-1: none); a name run.json does not
    list matches across all ranks (instance 0)."""
    out: dict[str, np.ndarray] = {}
    listed: dict[str, list[list[int]]] = {}
    for g in meta.get("groups") or []:
        if isinstance(g, dict) and isinstance(g.get("ranks"), list):
            listed.setdefault(str(g.get("name")), []).append(g["ranks"])
    for name in names:
        arr = np.zeros(ranks_max + 1, dtype=np.int64)
        if name in listed:
            arr[:] = -1
            for i, ranks in enumerate(listed[name]):
                r = np.asarray(ranks, dtype=np.int64)
                r = r[(r >= 0) & (r <= ranks_max)]
                arr[r] = i
        out[name] = arr
    return out


def _groups(tpl: Template, slots: Slots, meta: dict) -> tuple[np.ndarray, int]:
    """The group of every collective slot (members end together); -1 for compute."""
    n = len(slots)
    group = np.full(n, -1, dtype=np.int64)
    comm = np.flatnonzero(slots.cls > 0)
    if not len(comm):
        return group, 0
    row = slots.a[comm]
    cls = slots.cls[comm]
    rank = slots.rank[comm]
    grp = tpl.grp[row].astype(str)
    seq = tpl.seq[row]
    peer = tpl.peer[row]
    names = sorted(set(grp[cls == 1]))
    inst = _group_instance(meta, names, int(tpl.rank.max()))
    gid = np.zeros(len(comm), dtype=np.int64)
    for name in names:
        m = (cls == 1) & (grp == name)
        gid[m] = inst[name][rank[m]]
    src = np.where(cls == 2, rank, np.where(cls == 3, peer, -1))
    dst = np.where(cls == 2, peer, np.where(cls == 3, rank, -1))
    frame = pd.DataFrame({
        "p2p": cls >= 2, "grp": np.where(cls >= 2, "", grp), "gid": np.where(cls >= 2, 0, gid),
        "src": src, "dst": dst, "seq": seq,
        # a rank in no instance of its group's name talks to nobody: a group of its own
        "alone": np.where((cls == 1) & (gid < 0), comm, -1),
    })  # fmt: skip
    ids = frame.groupby(list(frame.columns), sort=False).ngroup().to_numpy()
    group[comm] = ids
    return group, int(ids.max()) + 1


def _levels(n, pred, cont, frac, group, n_groups, members, member_start):
    """Kahn's order of the nodes: slots ``0..n-1`` and groups ``n..n+n_groups-1``."""
    node_end = np.where(group >= 0, n + group, np.arange(n))  # where a slot's end is known
    has_p = pred >= 0
    has_c = cont >= 0
    c_idx = np.flatnonzero(has_c)
    needs_end = frac[c_idx] > 0
    src_parts = [
        node_end[pred[has_p]],
        np.where(needs_end, node_end[cont[c_idx]], cont[c_idx]),
        members,
    ]
    dst_parts = [np.flatnonzero(has_p), c_idx, n + group[members]]
    src = np.concatenate(src_parts).astype(np.int64)
    dst = np.concatenate(dst_parts).astype(np.int64)
    total = n + n_groups
    keep = src != dst
    src, dst = src[keep], dst[keep]
    indeg = np.bincount(dst, minlength=total)
    order = np.argsort(src, kind="stable")
    succ = dst[order]
    succ_start = np.searchsorted(src[order], np.arange(total + 1))
    frontier = np.flatnonzero(indeg == 0)
    levels = []
    done = 0
    while len(frontier):
        done += len(frontier)
        levels.append((frontier[frontier < n], frontier[frontier >= n] - n))
        counts = succ_start[frontier + 1] - succ_start[frontier]
        if counts.sum() == 0:
            break
        starts = np.repeat(succ_start[frontier], counts)
        offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        nxt = succ[starts + offs]
        dec = np.bincount(nxt, minlength=total)
        touched = np.flatnonzero(dec)
        indeg[touched] -= dec[touched]
        frontier = touched[indeg[touched] == 0]
    if done != total:
        raise WhatIfError(
            f"the dependency graph has a cycle ({total - done} of {total} operations unreachable)"
        )
    return levels
