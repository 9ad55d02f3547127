"""Import PyTorch Flight Recorder dumps (one file per rank) as a run directory.

A dump (gzip-compressed or not) is what ``torch.distributed`` writes on a watchdog timeout (pickle, e.g. format 2.9)
or what ``_dump_fr_trace_json`` / ``_dump_fr_trace`` return (JSON or pickle, 2.10), from NCCL
or gloo: ``pg_config`` (every process group of the rank: name, description, ranks; nearly
empty on gloo), ``pg_status`` (per group index ``pg_id``: last enqueued, started and completed
work) and ``entries``, the ring buffer of the rank's most recent operations (on a timeout often
only the ones still active), each with its group, ``collective_seq_id``, ``p2p_seq_id``,
``op_id``, ``profiling_name``, state, sizes and times.

**A dump is data, never code.** Pickles are read with :class:`DataOnlyUnpickler`, whose
``find_class`` refuses every global, so only the pickle opcodes of plain containers and
scalars can build anything; a file that names a global is refused with a one-line error.
So is a dump of a format version this reader does not know (2.x is known), and a folder whose
dumps cannot come from one job (two dumps of one rank, one group with two memberships or
descriptions, different format versions or backends).

Each entry becomes a ``collectives`` row: ``group`` is the group's label (see
:mod:`analyzer.importers.groups`), ``seq`` the ``collective_seq_id`` (``p2p_seq_id`` for
send/recv, whose ``peer`` is parsed from ``nccl:send 9->1`` and mapped from the group's local
numbering to global ranks), ``issue_ns`` the creation time, ``start_ns`` the discovered start
or the issue time, ``end_ns`` the discovered completion, or ``start_ns`` when the entry is
known to have completed without a recorded time, or null when it had not completed.

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
``flight_recorder_status``, op ``unknown`` unless another rank recorded that seq).

Each rank gets one ``heartbeats`` row (its latest time, the last entry's state); ``run.json``
says ``hung`` when some entry never completed or some rank of the job left no dump. Ranks in the groups with no dump are listed in
``run.json`` (``import.missing_ranks``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import zlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from analyzer.importers.common import (
    ImportResult,
    RefusedTrace,
    TraceError,
    dtype_bytes,
    empty_columns,
    list_files,
    load_all,
    normalize_op,
    numel,
    prepare_out_dir,
    rank_from_filename,
    write_run_json,
    write_table,
    write_topology,
)
from analyzer.importers.groups import (
    Group,
    complete_groups,
    derive_mesh,
    fallback_mesh,
    label_groups,
    parse_ranks,
    run_json_groups,
)

log = logging.getLogger(__name__)

_P2P_RE = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")
_DONE_STATES = {"completed"}
_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)\s*$")
KNOWN_MAJOR = 2
MAX_DUMP_BYTES = 1 << 30  # a gzip dump inflated past this is refused
P2P_RENUMBER_BASE = 1 << 40  # renumbered send/recv: unfinished ones count up from here


class MixedDumps(TraceError):
    """A folder whose dumps cannot all come from one job."""


class UnknownVersion(RefusedTrace):
    """A dump of a format version this reader does not know: never guessed at, never skipped."""


class DataOnlyUnpickler(pickle.Unpickler):
    """An unpickler that admits no global at all: dicts, lists, tuples, str, bytes, numbers,
    booleans and None build; anything that would import or call is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing persistent id")


def check_version(path: str, dump: Mapping[str, Any]) -> str:
    """The dump's format version; :class:`UnknownVersion` unless it is 2.x."""
    raw = dump.get("version")
    m = _VERSION_RE.match(str(raw)) if raw is not None else None
    if m is None or int(m.group(1)) != KNOWN_MAJOR:
        raise UnknownVersion(
            f"{path}: unknown Flight Recorder format version {raw!r} (this reader knows "
            f"{KNOWN_MAJOR}.x)"
        )
    return f"{int(m.group(1))}.{int(m.group(2))}"


def _gunzip(path: str, data: bytes) -> bytes:
    """A gzip-compressed dump, inflated up to ``MAX_DUMP_BYTES``."""
    z = zlib.decompressobj(wbits=31)
    try:
        out = z.decompress(data, MAX_DUMP_BYTES)
    except zlib.error as e:
        raise TraceError(f"{path}: truncated or malformed gzip ({e})") from None
    if z.unconsumed_tail:
        raise TraceError(f"{path}: inflates past {MAX_DUMP_BYTES >> 20} MiB: not a dump")
    if not z.eof:
        raise TraceError(f"{path}: truncated gzip")
    return out


def load_dump(path: str) -> dict[str, Any]:
    """One dump (pickle or JSON) as a dict; :class:`TraceError` names the file otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})") from None
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(path, data)
    head = data.lstrip()[:1]
    if head == b"{":
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise TraceError(f"{path}: truncated or malformed JSON dump ({e})") from None
    elif data[:1] == b"\x80":
        try:
            obj = DataOnlyUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            if str(e).startswith("refusing"):
                raise RefusedTrace(f"{path}: {e} (a dump holds only plain data)") from None
            raise TraceError(f"{path}: truncated or malformed pickle ({e})") from None
        except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
            raise TraceError(
                f"{path}: truncated or malformed pickle ({type(e).__name__})"
            ) from None
    else:
        raise TraceError(f"{path}: not a Flight Recorder dump (neither pickle nor JSON)")
    entries = obj.get("entries") if isinstance(obj, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise TraceError(f"{path}: not a Flight Recorder dump (no list of entries)")
    check_version(path, obj)
    return obj


def _int(value: Any) -> int | None:
    """Ints as dumps store them (int, numeric string); 0, '', None and junk -> None."""
    try:
        v = int(value)
    except (TypeError, ValueError):
        return None
    return v or None


def _signed(value: Any) -> int | None:
    """An int that may be 0 or negative (``pg_status`` numbers; -1: none yet)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _pg_of(entry: Mapping[str, Any]) -> tuple[str, str]:
    pg = entry.get("process_group") or ("", "")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        return str(pg[0]), str(pg[1])
    return str(pg), ""


def _backend(entry: Mapping[str, Any]) -> str:
    name = str(entry.get("profiling_name", ""))
    return name.split(":", 1)[0].lower() if ":" in name else ""


def collect_groups(dumps: Mapping[int, Mapping[str, Any]]) -> tuple[dict[str, Group], int]:
    """Every process group seen in any dump, and the world size.

    Members come from ``pg_config``; where a dump recorded none (gloo writes ``"[]"``), the
    members are the ranks whose entries use the group, completed from the mesh the groups'
    descriptions give for ranks that left no dump (see :func:`groups.complete_groups`), and
    ``default_pg`` is the whole world.
    """
    desc: dict[str, str] = {}
    ranks: dict[str, set[int]] = {}
    users: dict[str, set[int]] = {}
    for rank, dump in dumps.items():
        config = dump.get("pg_config") or {}
        for key, pg in config.items() if isinstance(config, dict) else ():
            if not isinstance(pg, dict):
                continue
            name = str(pg.get("name", key))
            if name:
                desc.setdefault(name, str(pg.get("desc", "")))
                ranks.setdefault(name, set()).update(parse_ranks(pg.get("ranks")))
        for entry in dump.get("entries", []):
            name, d = _pg_of(entry)
            desc.setdefault(name, d)
            users.setdefault(name, set()).add(rank)
    world = max([r for rs in ranks.values() for r in rs] + list(dumps)) + 1
    groups = {}
    for name, d in desc.items():
        members = ranks.get(name) or users.get(name, set())
        groups[name] = Group(name, d, tuple(sorted(members)))
    unlisted = {n for n in groups if not ranks.get(n) and groups[n].desc != "default_pg"}
    if unlisted:
        groups, world = complete_groups(groups, unlisted, set(dumps), world)
    for name, g in list(groups.items()):
        if g.desc == "default_pg" and not ranks.get(name):
            groups[name] = Group(name, g.desc, tuple(range(world)))
    return groups, world


def check_one_job(origin: Mapping[int, str], dumps: Mapping[int, Mapping[str, Any]]) -> None:
    """:class:`MixedDumps` when the dumps cannot come from one job (see the module docstring)."""
    seen: dict[str, tuple[int, str]] = {}
    for key in ("version", "nccl_version"):
        for rank, dump in dumps.items():
            value = str(dump.get(key) or "")
            first = seen.setdefault(key, (rank, value))
            if value != first[1]:
                raise MixedDumps(
                    f"{origin[rank]}: {key} {value!r}, but {origin[first[0]]} has "
                    f"{first[1]!r}: dumps from two jobs in one folder?"
                )
    backends: dict[str, int] = {}
    members: dict[str, tuple[int, tuple[int, ...], str]] = {}
    for rank, dump in dumps.items():
        for entry in dump.get("entries", []):
            b = _backend(entry)
            if b:
                backends.setdefault(b, rank)
        config = dump.get("pg_config") or {}
        for key, pg in config.items() if isinstance(config, dict) else ():
            if not isinstance(pg, dict):
                continue
            name, desc = str(pg.get("name", key)), str(pg.get("desc", ""))
            rs = parse_ranks(pg.get("ranks"))
            if not name or not rs:
                continue
            first = members.setdefault(name, (rank, rs, desc))
            if (rs, desc) != first[1:]:
                raise MixedDumps(
                    f"{origin[rank]}: process group {name} ({desc}) has ranks {list(rs)}, but "
                    f"{origin[first[0]]} says {list(first[1])} ({first[2]}): dumps from two "
                    "jobs in one folder?"
                )
    if len(backends) > 1:
        (a, ra), (b, rb) = sorted(backends.items())[:2]
        raise MixedDumps(
            f"{origin[rb]}: {b} entries, but {origin[ra]} has {a} entries: dumps from two jobs "
            "in one folder?"
        )


@dataclass
class _Entry:
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


def _parse(entry: Mapping[str, Any]) -> _Entry:
    name = str(entry.get("profiling_name", ""))
    p2p = bool(entry.get("is_p2p")) or bool(_P2P_RE.search(name))
    seq = int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
    pg_name, desc = _pg_of(entry)
    done = str(entry.get("state", "")) in _DONE_STATES or entry.get("retired") is True
    return _Entry(
        raw=entry, record_id=int(entry.get("record_id") or 0), pg_name=pg_name, desc=desc,
        pg_id=str(entry.get("pg_id")), p2p=p2p, seq=seq, op_id=int(entry.get("op_id") or 0),
        name=name, done=done,
    )  # fmt: skip


def _is_coalesced(e: _Entry) -> bool:
    return e.name.split(":", 1)[-1].strip().lower().startswith("coalesced")


def _fold_coalesced(entries: list[_Entry]) -> list[_Entry]:
    """Give a coalesced group's ops the completion of its ``coalesced`` entry, and drop that
    entry; one with no recorded ops stays (a collective) or goes (send/recv without peers)."""
    parts: dict[tuple[str, bool, int], list[_Entry]] = defaultdict(list)
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
    entries: list[_Entry],
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
    by_pg: dict[str, list[_Entry]] = defaultdict(list)
    for e in entries:
        by_pg[e.pg_id].append(e)
    spaces: dict[str, tuple[str, int]] = {}
    for pg_id, st in status.items() if isinstance(status, Mapping) else ():
        if not isinstance(st, Mapping):
            continue
        done = _signed(st.get("last_completed_collective"))
        queued = _signed(st.get("last_enqueued_collective"))
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


def _space_of(done: int, kinds: Mapping[bool, list[int]], mine: list[_Entry] = ()) -> str:
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


def _row(e: _Entry, rank: int, group: Group | None, label: str, peer: int) -> dict[str, Any]:
    """One collectives row for one entry (see the module docstring for each column)."""
    entry = e.raw
    dtypes = entry.get("input_dtypes") or []
    sizes = entry.get("input_sizes") or []
    nbytes = sum(numel(s) * dtype_bytes(d) for s, d in zip(sizes, dtypes, strict=False))
    issue = _int(entry.get("time_created_ns")) or 0
    start = _int(entry.get("time_discovered_started_ns")) or issue
    end = _int(entry.get("time_discovered_completed_ns"))
    raw = e.name.split(":", 1)[-1].split(" ")[0] or "unknown"
    return {
        "rank": rank, "step": -1, "microbatch": -1, "op": normalize_op(e.name) or raw,
        "group": label, "group_size": len(group.ranks) if group else 0, "seq": e.seq,
        "peer": peer, "nbytes": nbytes, "dtype": str(dtypes[0]).lower() if dtypes else "",
        "issue_ns": issue, "start_ns": start, "end_ns": (end or start) if e.done else None,
        "source": "flight_recorder",
    }  # fmt: skip


@dataclass
class _Rank:
    """One rank's parsed entries and what its ``pg_status`` said."""

    rank: int
    entries: list[_Entry]
    spaces: dict[str, tuple[str, int]]
    peers: dict[int, int]  # id(entry) -> global peer


def _prepare(
    dumps: Mapping[int, Mapping[str, Any]], groups: Mapping[str, Group], backend: str
) -> tuple[dict[int, _Rank], dict[str, dict[bool, list[int]]]]:
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
        out[rank] = _Rank(rank, entries, spaces, peers)
    return out, kinds


def _retire_lag(ranks: Mapping[int, _Rank], groups: Mapping[str, Group]) -> None:
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


def _renumber_p2p(ranks: Mapping[int, _Rank]) -> list[str]:
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
        chains: dict[tuple[str, int, bool], list[_Entry]] = defaultdict(list)
        for e in r.entries:
            if e.p2p and e.pg_name in multi:
                send = e.name.split(":", 1)[-1].strip().lower().startswith("send")
                chains[(e.pg_name, r.peers[id(e)], send)].append(e)
        for chain in chains.values():
            first_open = next((i for i, e in enumerate(chain) if not e.done), len(chain))
            for i, e in enumerate(chain):
                e.seq = P2P_RENUMBER_BASE + 1 + i - first_open
    return sorted(multi)


def _markers(
    ranks: Mapping[int, _Rank],
    groups: Mapping[str, Group],
    kinds: Mapping[str, Mapping[bool, list[int]]],
) -> dict[int, list[tuple[str, int]]]:
    """Per rank, (group name, seq) of the collectives ``pg_status`` says it finished past its
    recorded entries (see the module docstring).

    ``pg_status`` is keyed by ``pg_id``, the group's place among the rank's own groups: a
    ``pg_id`` the rank has no entry of is the group that plays the same part on the ranks that
    do (the same description and size), when the rank has exactly one such group without
    entries; with undescribed groups, also the only one whose other members' seqs are near.
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
        free = [
            g for g in groups.values()
            if r.rank in g.ranks and g.name not in used and seqs.get(g.name) and len(g.ranks) > 1
        ]  # fmt: skip
        for pg_id, (space, done) in r.spaces.items():
            if space not in ("coll", "?") or done < 1:
                continue
            name = named.get(pg_id)
            if name is None:
                if len(roles.get(pg_id, ())) != 1:
                    continue
                ((desc, size),) = roles[pg_id]
                near = [g for g in free if g.desc == desc and len(g.ranks) == size]
                if desc in ("", "undefined"):
                    near = [g for g in near if _near(seqs[g.name], done)]
                if len(near) != 1:
                    continue
                name = near[0].name
                free.remove(near[0])
                if _space_of(done, kinds.get(name, {})) != "coll":
                    continue
            top = max((e.seq for e in r.entries if e.pg_name == name and not e.p2p), default=0)
            if done > top:
                out[r.rank].append((name, done))
    return out


def _near(seqs: list[int], value: int) -> bool:
    lo, hi = min(seqs), max(seqs)
    slack = max(4, (hi - lo) // 2)
    return lo - slack <= value <= hi + slack


def _convert_rank(
    run_dir: str,
    r: _Rank,
    groups: Mapping[str, Group],
    labels: Mapping[str, str],
    markers: list[tuple[str, int]],
    ops_at: Mapping[tuple[str, int], str],
    t_first: int,
) -> tuple[int, bool]:
    """Write one rank's collectives and heartbeat; returns (rows, whether something is stuck)."""
    cols = empty_columns("collectives")
    stuck = False
    last_ts, last_state = 0, "idle"
    for e in r.entries:
        group = groups.get(e.pg_name)
        row = _row(e, r.rank, group, labels.get(e.pg_name, e.desc), r.peers[id(e)])
        for k, v in row.items():
            cols[k].append(v)
        stuck |= row["end_ns"] is None
        last_ts = max(last_ts, row["issue_ns"], row["start_ns"], row["end_ns"] or 0)
        last_state = str(e.raw.get("state", "unknown"))
    times = [t for t in cols["issue_ns"] if t]
    t0 = min(times) if times else t_first
    for name, seq in markers:
        group = groups.get(name)
        row = {
            "rank": r.rank, "step": -1, "microbatch": -1, "op": ops_at.get((name, seq), "unknown"),
            "group": labels.get(name, name), "group_size": len(group.ranks) if group else 0,
            "seq": seq, "peer": -1, "nbytes": 0, "dtype": "", "issue_ns": t0, "start_ns": t0,
            "end_ns": t0, "source": "flight_recorder_status",
        }  # fmt: skip
        for k, v in row.items():
            cols[k].append(v)
    n = write_table(run_dir, "collectives", r.rank, cols)
    beat = {"rank": [r.rank], "ts_ns": [last_ts or t0], "step": [-1], "state": [last_state]}
    write_table(run_dir, "heartbeats", r.rank, beat)
    return n, stuck


def _rank_of_dump(path: str, dump: Mapping[str, Any]) -> int:
    rank = dump.get("rank")
    if isinstance(rank, int) and rank >= 0:
        return rank
    rank = rank_from_filename(path)
    if rank is None:
        raise TraceError(f"{path}: cannot tell the rank (no 'rank' key, no number in the name)")
    return rank


def import_flight_recorder(directory: str, out: str, *, strict: bool = False) -> ImportResult:
    """Import every dump in ``directory`` (one per rank) into the run directory ``out``."""
    paths = list_files(directory, lambda p: not p.endswith((".log", ".txt", ".md")))
    if not paths:
        raise TraceError(f"{directory}: no Flight Recorder dumps")
    # A refused pickle (RefusedTrace) is never skipped: a set that holds code is not imported.
    loaded, skipped = load_all(paths, load_dump, strict=strict)
    dumps: dict[int, dict[str, Any]] = {}
    origin: dict[int, str] = {}
    for path, dump in loaded:
        rank = _rank_of_dump(path, dump)
        if rank in dumps:
            raise MixedDumps(
                f"{path}: a second dump for rank {rank} (the first is {origin[rank]}): dumps "
                "from two jobs in one folder?"
            )
        dumps[rank], origin[rank] = dump, path
    check_one_job(origin, dumps)
    groups, world = collect_groups(dumps)
    mesh = derive_mesh(groups.values(), world) or fallback_mesh(world)
    labels = label_groups(groups.values(), mesh)
    try:
        backend = next((b for d in dumps.values() for e in d.get("entries", [])
                        if (b := _backend(e))), "")  # fmt: skip
        ranks, kinds = _prepare(dumps, groups, backend)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TraceError(f"{directory}: malformed entry ({type(e).__name__}: {e})") from None
    if backend == "gloo":
        _retire_lag(ranks, groups)
    renumbered = _renumber_p2p(ranks)
    markers = _markers(ranks, groups, kinds)
    ops_at: dict[tuple[str, int], str] = {}
    for r in ranks.values():
        for e in r.entries:
            if not e.p2p:
                ops_at.setdefault((e.pg_name, e.seq), normalize_op(e.name) or "unknown")
    times = [_int(e.raw.get("time_created_ns")) for r in ranks.values() for e in r.entries]
    t_first = min((t for t in times if t), default=0)
    prepare_out_dir(out)
    result = ImportResult(run_dir=out, ranks=sorted(dumps), skipped=skipped)
    stuck = False
    for rank in sorted(dumps):
        n, s = _convert_rank(
            out, ranks[rank], groups, labels, markers.get(rank, []), ops_at, t_first
        )
        result.rows["collectives"] = result.rows.get("collectives", 0) + n
        stuck |= s
    nccl = any(str(d.get("nccl_version") or "").strip() for d in dumps.values())
    device = "cuda" if nccl else "cpu"
    write_topology(out, sorted(dumps), mesh, device=device)
    members = {r for g in groups.values() for r in g.ranks} | set(range(world))
    missing = sorted(members - set(dumps))
    result.status = "hung" if stuck or missing else "finished"
    versions = {k: next((str(d[k]) for d in dumps.values() if d.get(k)), None)
                for k in ("version", "nccl_version", "comm_lib_version")}  # fmt: skip
    write_run_json(
        out, world_size=world, mesh=mesh, groups=run_json_groups(groups.values(), labels),
        device=device, status=result.status,
        source={"tool": "flight_recorder", "directory": os.path.abspath(directory),
                "files": [os.path.basename(p) for p, _ in loaded], "skipped": skipped,
                "versions": versions, "missing_ranks": missing,
                "p2p_renumbered": renumbered,
                "status_rows": sum(len(v) for v in markers.values())},
    )  # fmt: skip
    return result
