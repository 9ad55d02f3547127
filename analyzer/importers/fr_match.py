"""Matching Flight Recorder entries across ranks: which work each entry is, and whether it
completed (see :mod:`analyzer.importers.flight_recorder` for the rows they become).

*Completed* means: state ``completed``; ``retired``; or covered by the group's
``last_completed_collective``. That number counts works in the group (NCCL: the collective or
the p2p sequence, whichever the work used; gloo: ``op_id``, which also counts the send/recv it
does not record): which space it is in is read off the group's latest entry.

*Coalesced* groups: the ops of a ``batch_isend_irecv`` or a coalesced collective are recorded
one by one, followed by one ``coalesced`` entry with the same sequence number that alone
tracks completion: its ops take its completion and it is dropped.

*Send/recv numbering*: NCCL numbers p2p per process group, across all peers of the rank. When
a rank talks to one peer in a group (a pipeline pair) both ends count alike and the number is
kept; when it talks to several, the ops of each (group, peer, direction) are renumbered in
order, the first unfinished one of every pair taking the same number on both ends.

*Retired late* (gloo): gloo retires an entry some time after its work ended, so a dump may
hold an entry not yet retired of a collective that another member retired: when every member
left a dump and entered it, it is done.

*Finished before the buffer*: a dump of the active entries keeps none of the collectives a
rank already finished, so a group it finished everything in would look never entered. Where
``pg_status`` says so, the rank gets one row at its last completed seq (``source``
``flight_recorder_status``); see :func:`status_markers` for how a ``pg_id`` the rank has no
entry of is told.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from analyzer.importers.fr_read import as_signed, pg_of
from analyzer.importers.groups import Group

_P2P_RE = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")
_DONE_STATES = {"completed"}
P2P_RENUMBER_BASE = 1 << 40  # renumbered send/recv: unfinished ones count up from here


@dataclass
class Entry:
    """One entry, parsed once."""

    raw: Mapping[str, Any]
    record_id: int
    pg_name: str
    desc: str
    pg_id: str
    p2p: bool
    seq: int
    op_id: int
    name: str
    done: bool


def _parse(entry: Mapping[str, Any]) -> Entry:
    name = str(entry.get("profiling_name", ""))
    p2p = bool(entry.get("is_p2p")) or bool(_P2P_RE.search(name))
    seq = int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
    pg_name, desc = pg_of(entry)
    done = str(entry.get("state", "")) in _DONE_STATES or entry.get("retired") is True
    return Entry(
        raw=entry, record_id=int(entry.get("record_id") or 0), pg_name=pg_name, desc=desc,
        pg_id=str(entry.get("pg_id")), p2p=p2p, seq=seq, op_id=int(entry.get("op_id") or 0),
        name=name, done=done,
    )  # fmt: skip


def _is_coalesced(e: Entry) -> bool:
    return e.name.split(":", 1)[-1].strip().lower().startswith("coalesced")


def _fold_coalesced(entries: list[Entry]) -> list[Entry]:
    """Give a coalesced group's ops the completion of its ``coalesced`` entry, and drop that
    entry; one with no recorded ops stays (a collective) or goes (send/recv without peers)."""
    parts: dict[tuple[str, bool, int], list[Entry]] = defaultdict(list)
    for e in entries:
        if not _is_coalesced(e):
            parts[(e.pg_name, e.p2p, e.seq)].append(e)
    out = []
    for e in entries:
        if not _is_coalesced(e):
            out.append(e)
            continue
        mine = parts.get((e.pg_name, e.p2p, e.seq), [])
        if mine:
            for part in mine:
                part.done = part.done or e.done
        elif not e.p2p:
            out.append(e)
    return out


def _status_done(
    entries: list[Entry],
    status: Mapping[str, Any],
    backend: str,
    kinds: dict[str, dict[bool, list[int]]],
) -> dict[str, tuple[str, int]]:
    """Mark entries that ``pg_status`` says completed; return, per ``pg_id``, the space of its
    completed number (``op`` on gloo; ``coll`` or ``p2p`` on NCCL) and the number.

    NCCL counts collectives and send/recv apart and reports the last work of either kind, so
    a group that carries both needs its space told: a completed number above the enqueued one
    of the latest entry's kind is the other kind's; a group only one kind was seen in (by any
    rank: ``kinds``, group name -> is_p2p -> seqs) is that kind's; else the nearer of the two.
    The completed numbers told apart are added to ``kinds``, for the ranks without entries.
    """
    by_pg: dict[str, list[Entry]] = defaultdict(list)
    for e in entries:
        by_pg[e.pg_id].append(e)
    spaces: dict[str, tuple[str, int]] = {}
    for pg_id, st in status.items() if isinstance(status, Mapping) else ():
        if not isinstance(st, Mapping):
            continue
        done = as_signed(st.get("last_completed_collective"))
        queued = as_signed(st.get("last_enqueued_collective"))
        mine = by_pg.get(str(pg_id), [])
        if done is None or done < 0:
            continue
        if not mine:
            spaces[str(pg_id)] = ("op" if backend == "gloo" else "?", done)
            continue
        latest = max(mine, key=lambda e: e.record_id)
        if backend == "gloo" or (queued == latest.op_id and latest.op_id != latest.seq):
            space = "op"
        elif queued == latest.seq and done > queued:
            space = "coll" if latest.p2p else "p2p"
        else:
            space = _space_of(done, kinds.get(latest.pg_name, {}), mine)
        spaces[str(pg_id)] = (space, done)
        if space in ("coll", "p2p"):  # what other ranks' numbers of this group may be
            kinds.setdefault(latest.pg_name, {False: [], True: []})[space == "p2p"].append(done)
        for e in mine:
            number = e.op_id if space == "op" else e.seq
            if (space == "op" or e.p2p == (space == "p2p")) and number <= done:
                e.done = True
    return spaces


def _space_of(done: int, kinds: Mapping[bool, list[int]], mine: Sequence[Entry] = ()) -> str:
    """``coll`` or ``p2p``: the kind a group carries, or of two, the one whose seqs (this
    rank's, else any rank's) are nearer ``done``."""
    if not kinds.get(True):
        return "coll"
    if not kinds.get(False):
        return "p2p"
    colls = [e.seq for e in mine if not e.p2p] or kinds[False]
    p2ps = [e.seq for e in mine if e.p2p] or kinds[True]
    return "coll" if abs(done - max(colls)) <= abs(done - max(p2ps)) else "p2p"


def _peer(entry: Mapping[str, Any], group: Group | None, rank: int) -> int:
    """The global rank at the other end of a send/recv (-1 for collectives).

    ``nccl:send 9->1`` and ``nccl:recv 1<-0`` put this rank on the left and the peer on the
    right, numbered within the group (NCCL numbers them so; on the default group that is the
    global rank): mapped through the group's ranks when the left number is this rank's place
    in the group, taken as global otherwise (a group whose members are not known).
    """
    m = _P2P_RE.search(str(entry.get("profiling_name", "")))
    if not m:
        return -1
    me, peer = int(m.group(1)), int(m.group(3))
    ranks = group.ranks if group else ()
    if me < len(ranks) and ranks[me] == rank and peer < len(ranks):
        return ranks[peer]
    return peer


@dataclass
class RankEntries:
    """One rank's parsed entries and what its ``pg_status`` said."""

    rank: int
    entries: list[Entry]
    spaces: dict[str, tuple[str, int]]
    peers: dict[int, int]  # id(entry) -> global peer
    status_ids: list[str] = field(default_factory=list)  # the pg_ids of its pg_status
    own_groups: list[str] = field(default_factory=list)  # the group names of its pg_config


def prepare(
    dumps: Mapping[int, Mapping[str, Any]], groups: Mapping[str, Group], backend: str
) -> tuple[dict[int, RankEntries], dict[str, dict[bool, list[int]]]]:
    """Every rank's entries parsed, coalesced groups folded, ``pg_status`` applied; and per
    group name, the seqs of its collectives (False) and send/recv (True) over all ranks."""
    parsed = {}
    kinds: dict[str, dict[bool, list[int]]] = defaultdict(lambda: {False: [], True: []})
    for rank in sorted(dumps):
        entries = sorted(
            (_parse(e) for e in dumps[rank].get("entries", [])), key=lambda e: e.record_id
        )
        parsed[rank] = _fold_coalesced(entries)
        for e in parsed[rank]:
            kinds[e.pg_name][e.p2p].append(e.seq)
    out = {}
    for rank, entries in parsed.items():
        spaces = _status_done(entries, dumps[rank].get("pg_status") or {}, backend, kinds)
        peers = {
            id(e): (_peer(e.raw, groups.get(e.pg_name), rank) if e.p2p else -1) for e in entries
        }
        status = dumps[rank].get("pg_status") or {}
        config = dumps[rank].get("pg_config") or {}
        own = [
            str(pg.get("name", key)) for key, pg in config.items() if isinstance(pg, Mapping)
        ] if isinstance(config, Mapping) else []  # fmt: skip
        ids = [str(k) for k in status] if isinstance(status, Mapping) else []
        out[rank] = RankEntries(rank, entries, spaces, peers, ids, own)
    return out, kinds


def retire_lag(ranks: Mapping[int, RankEntries], groups: Mapping[str, Group]) -> None:
    """gloo retires an entry some time after its work ended: an entry not yet retired of a
    collective that another member retired, when every member left a dump and entered it, is
    done (see the module docstring)."""
    retired: dict[tuple[str, int], bool] = defaultdict(bool)
    last: dict[tuple[str, int], int] = defaultdict(lambda: -1)  # (group, rank) -> last seq
    for r in ranks.values():
        for e in r.entries:
            if not e.p2p:
                retired[(e.pg_name, e.seq)] |= e.done
                last[(e.pg_name, r.rank)] = max(last[(e.pg_name, r.rank)], e.seq)
    for r in ranks.values():
        for e in r.entries:
            if e.done or e.p2p or not retired[(e.pg_name, e.seq)]:
                continue
            members = groups[e.pg_name].ranks if e.pg_name in groups else ()
            if members and all(m in ranks and last[(e.pg_name, m)] >= e.seq for m in members):
                e.done = True


def renumber_p2p(ranks: Mapping[int, RankEntries]) -> list[str]:
    """Renumber send/recv per (group, peer, direction) in groups where a rank talks to several
    peers (see the module docstring); returns those groups' names."""
    multi: set[str] = set()
    for r in ranks.values():
        peers_of: dict[str, set[int]] = defaultdict(set)
        for e in r.entries:
            if e.p2p:
                peers_of[e.pg_name].add(r.peers[id(e)])
        multi |= {pg for pg, ps in peers_of.items() if len(ps) > 1}
    for r in ranks.values():
        chains: dict[tuple[str, int, bool], list[Entry]] = defaultdict(list)
        for e in r.entries:
            if e.p2p and e.pg_name in multi:
                send = e.name.split(":", 1)[-1].strip().lower().startswith("send")
                chains[(e.pg_name, r.peers[id(e)], send)].append(e)
        for chain in chains.values():
            first_open = next((i for i, e in enumerate(chain) if not e.done), len(chain))
            for i, e in enumerate(chain):
                e.seq = P2P_RENUMBER_BASE + 1 + i - first_open
    return sorted(multi)


def status_markers(
    ranks: Mapping[int, RankEntries],
    groups: Mapping[str, Group],
    kinds: Mapping[str, Mapping[bool, list[int]]],
) -> dict[int, list[tuple[str, int]]]:
    """Per rank, (group name, seq) of the collectives ``pg_status`` says it finished past its
    recorded entries (see the module docstring).

    ``pg_status`` is keyed by ``pg_id``, the group's place among the rank's own groups, in
    the order they were created: when its ``pg_status`` and its ``pg_config`` list as many
    groups and every name and ``pg_id`` is a number (the group names torch gives count the
    groups created), the n-th ``pg_id`` is the n-th group name, if that agrees with every
    entry's. Failing that, a ``pg_id`` the rank has no entry of is the group that plays the
    same part on the ranks that do (the same description and size), when the rank has exactly
    one such group without entries; with undescribed groups, also the only one whose other
    members' seqs are near. A number past every collective seq the group's members recorded
    is not a collective's (a collective completes with every member): it is left out.
    """
    seqs: dict[str, list[int]] = defaultdict(list)
    roles: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for r in ranks.values():
        for e in r.entries:
            g = groups.get(e.pg_name)
            roles[e.pg_id].add((e.desc, len(g.ranks) if g else 0))
            if not e.p2p:
                seqs[e.pg_name].append(e.seq)
    out: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for r in ranks.values():
        named = {e.pg_id: e.pg_name for e in r.entries}
        used = set(named.values())
        in_order = _in_creation_order(r, named)
        free = [
            g for g in groups.values()
            if r.rank in g.ranks and g.name not in used and seqs.get(g.name) and len(g.ranks) > 1
        ]  # fmt: skip
        for pg_id, (space, done) in r.spaces.items():
            if space not in ("coll", "?") or done < 1:
                continue
            name = named.get(pg_id)
            if name is None:
                name = in_order.get(pg_id) or _by_role(roles.get(pg_id, set()), done, free, seqs)
                # a collective completes with every member: never past what any entered
                if name not in seqs or done > max(seqs[name]):
                    continue
                if _space_of(done, kinds.get(name, {})) != "coll":
                    continue
            top = max((e.seq for e in r.entries if e.pg_name == name and not e.p2p), default=0)
            if done > top:
                out[r.rank].append((name, done))
    return out


def _by_role(
    roles: set[tuple[str, int]], done: int, free: list[Group], seqs: Mapping[str, list[int]]
) -> str | None:
    """The only group of ``free`` (taken out of it) that plays the part ``roles`` name (see
    :func:`status_markers`), or None."""
    if len(roles) != 1:
        return None
    ((desc, size),) = roles
    near = [g for g in free if g.desc == desc and len(g.ranks) == size]
    if desc in ("", "undefined"):
        near = [g for g in near if _near(seqs[g.name], done)]
    if len(near) != 1:
        return None
    free.remove(near[0])
    return near[0].name


def _in_creation_order(r: RankEntries, named: Mapping[str, str]) -> dict[str, str]:
    """``pg_id`` -> group name by creation order (see :func:`status_markers`), or nothing."""
    ids, names = r.status_ids, r.own_groups
    if len(ids) != len(names) or not all(x.isdigit() for x in (*ids, *names)):
        return {}
    pairs = dict(zip(sorted(ids, key=int), sorted(names, key=int), strict=True))
    if any(pairs.get(k) != v for k, v in named.items()):
        return {}
    return pairs


def _near(seqs: list[int], value: int) -> bool:
    lo, hi = min(seqs), max(seqs)
    slack = max(4, (hi - lo) // 2)
    return lo - slack <= value <= hi + slack
