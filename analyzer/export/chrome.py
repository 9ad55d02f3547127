"""Export a run directory as Chrome trace-event JSON, which Perfetto and chrome://tracing open.

Layout: one process per rank (``pid`` = rank, named ``rank 5 (dp1 pp0 tp1)``), and in it one
thread per lane of host spans, device spans and collectives. Slices are complete events
(``"ph": "X"``, microseconds since the run's earliest event, kept in ``otherData``). Slices
on one thread must not partly overlap, so each kind of row is dealt into lanes greedily
(the first lane free at the row's start); device kernels of several streams, or async
collectives, simply take more lanes.

A collective that never completed (null ``end_ns``) is drawn up to the end of the trace and
named ``... (incomplete)``. Collectives are linked across ranks by flow events: the members
of one group instance with the same ``seq`` (and, for send/recv, the same peer pair) form one
collective; an arrow (``"s"`` -> ``"f"``, ``"bp": "e"``, bound to the enclosing slices) runs
from the member that started last, the one the others waited for, to each other member.

The output is written as it is produced (one event per line); rows are read from DuckDB in
batches, and only one small tuple per collective is kept for the flows.

With ``ideal=True`` (``--ideal``) the what-if's ideal replay of every step is written beside
the measured timeline, one more process per rank (:mod:`analyzer.export.chrome_ideal`); the
measured processes then sort as ``2 * rank`` and the ideal ones as ``2 * rank + 1``.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import IO, Any

import duckdb

from analyzer.duck import sql_text

log = logging.getLogger(__name__)

HOST_TID, DEVICE_TID, COLL_TID = 1, 1001, 2001
_THREADS = {HOST_TID: "spans (host)", DEVICE_TID: "spans (cuda)", COLL_TID: "collectives"}
BATCH = 65536


class ExportError(ValueError):
    """A run that cannot be exported (one line)."""


def _rows(con: duckdb.DuckDBPyConnection, name: str) -> Iterator[tuple]:
    """Rows of the query ``analyzer/sql/export/NAME.sql``, fetched in batches."""
    cur = con.execute(sql_text(f"export/{name}"))
    while batch := cur.fetchmany(BATCH):
        yield from batch


class Lanes:
    """Greedy lane assignment per (rank, base tid): the first lane free at a start time."""

    def __init__(self) -> None:
        self.ends: dict[tuple[int, int], list[int]] = defaultdict(list)

    def take(self, rank: int, base: int, start: int, end: int) -> int:
        """The tid of the first lane of ``(rank, base)`` free at ``start``, then taken until
        ``end``; a new lane when none is free."""
        ends = self.ends[(rank, base)]
        for i, free_at in enumerate(ends):
            if free_at <= start:
                ends[i] = end
                return base + i
        ends.append(end)
        return base + len(ends) - 1


class Writer:
    """Streams trace events into an open file, one JSON object per line."""

    def __init__(self, f: IO[str], origin_ns: int) -> None:
        self.f, self.origin, self.first, self.count = f, origin_ns, True, 0

    def us(self, ns: int) -> str:
        """``ns`` as the trace's microseconds since the origin, three decimals."""
        return f"{(ns - self.origin) / 1000.0:.3f}"

    def raw(self, text: str) -> None:
        """Write one event already in JSON, after a comma unless it is the first, and count it."""
        self.f.write(("" if self.first else ",\n") + text)
        self.first = False
        self.count += 1

    def meta(self, name: str, pid: int, tid: int, args: Mapping[str, Any]) -> None:
        """A metadata event (``ph`` M): a process or thread name, say."""
        self.raw(json.dumps({"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}))

    def slice(self, pid: int, tid: int, start: int, end: int, name: str, cat: str,
              args: Mapping[str, Any]) -> None:  # fmt: skip
        """A complete event (``ph`` X) from ``start`` to ``end`` (ns)."""
        dur = max(end - start, 0) / 1000.0
        self.raw(
            f'{{"ph":"X","pid":{pid},"tid":{tid},"ts":{self.us(start)},"dur":{dur:.3f},'
            f'"name":{json.dumps(name)},"cat":{json.dumps(cat)},"args":{json.dumps(args, default=str)}}}'
        )

    def flow(self, ph: str, fid: int, pid: int, tid: int, ts: int, name: str) -> None:
        """One end of a collective's flow arrow: ``ph`` ``s`` starts it, ``f`` ends it, bound
        to the enclosing slice."""
        bind = ',"bp":"e"' if ph == "f" else ""
        self.raw(
            f'{{"ph":"{ph}","id":{fid},"pid":{pid},"tid":{tid},"ts":{self.us(ts)},'
            f'"name":{json.dumps(name)},"cat":"collective"{bind}}}'
        )


def _rank_names(con: duckdb.DuckDBPyConnection, mesh: Mapping[str, int]) -> dict[int, str]:
    """``rank N (dp0 pp1 tp1)`` for every rank with data (cp shown when the mesh has it)."""
    axes = [a for a in ("dp", "pp", "tp", "cp") if a != "cp" or int(mesh.get("cp", 1)) > 1]
    names = {}
    for rank, dp, pp, tp, cp, _host in _rows(con, "chrome_ranks"):
        c = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
        names[int(rank)] = f"rank {rank} ({' '.join(f'{a}{c[a]}' for a in axes)})"
    return names


def _instances(meta: Mapping[str, Any]) -> dict[tuple[str, int], tuple[int, ...]]:
    """(group label, rank) -> the members of that rank's group of that label (run.json)."""
    out: dict[tuple[str, int], tuple[int, ...]] = {}
    for g in meta.get("groups") or []:
        ranks = tuple(int(r) for r in g.get("ranks") or [])
        for r in ranks:
            out.setdefault((str(g.get("name")), r), ranks)
    return out


def _write_spans(con, w: Writer, lanes: Lanes, end_of_trace: int) -> int:
    n = 0
    for rank, step, mb, name, kind, start, end, source in _rows(con, "chrome_spans"):
        base = DEVICE_TID if source == "cuda" else HOST_TID
        stop = end if end is not None else end_of_trace
        tid = lanes.take(rank, base, start, stop)
        label = name if end is not None else f"{name} (incomplete)"
        w.slice(rank, tid, start, stop, label, kind or "span",
                {"step": step, "microbatch": mb, "source": source})  # fmt: skip
        n += 1
    return n


def _write_collectives(con, w: Writer, lanes: Lanes, end_of_trace: int, meta) -> dict:
    """Collective slices; returns ``{collective key: [(rank, tid, start, end)]}`` for flows."""
    instances = _instances(meta)
    members: dict[tuple, list[tuple[int, int, int, int]]] = defaultdict(list)
    rows = _rows(con, "chrome_collectives")
    for rank, step, op, group, size, seq, peer, nbytes, dtype, issue, start, end in rows:
        stop = end if end is not None else end_of_trace
        tid = lanes.take(rank, COLL_TID, start, stop)
        name = f"{op} {group}" + ("" if end is not None else " (incomplete)")
        args = {"group": group, "seq": seq, "group_size": size, "nbytes": nbytes,
                "dtype": dtype, "step": step, "issue_us": w.us(issue) if issue else None}  # fmt: skip
        if peer is not None and peer >= 0:
            args["peer"] = peer
        w.slice(rank, tid, start, stop, name, "collective", args)
        inst = instances.get((group, rank), ())
        key: tuple
        if op in ("send", "recv") and peer is not None and peer >= 0:
            key = (group, inst, "p2p", min(rank, peer), max(rank, peer), seq)
        else:
            key = (group, inst, seq)
        members[key].append((rank, tid, start, stop))
    return members


def _write_flows(w: Writer, members: Mapping[tuple, list[tuple[int, int, int, int]]]) -> int:
    """One arrow from the last member to start to each other member (see module docstring)."""
    fid = 0
    for key, ms in members.items():
        if len({m[0] for m in ms}) < 2:
            continue
        src = max(ms, key=lambda m: (m[2], m[0]))
        name = f"{key[0]} seq {key[-1]}"
        for rank, tid, start, stop in ms:
            if rank == src[0]:
                continue
            fid += 1
            at = src[2] if start <= src[2] <= stop else start
            w.flow("s", fid, src[0], src[1], src[2], name)
            w.flow("f", fid, rank, tid, at, name)
    return fid


def export_chrome(run_dir: str, out_path: str, ideal: bool = False) -> dict[str, int]:
    """Write ``out_path``; returns counts (events, spans, collectives, flows, ranks, and with
    ``ideal`` the ideal replay's slices)."""
    from analyzer.db import RunError, open_run

    try:
        run = open_run(run_dir)
    except RunError as e:
        raise ExportError(str(e)) from None
    try:
        replay = None
        if ideal:
            from analyzer.export.chrome_ideal import replay_ideal
            from analyzer.whatif import WhatIfError

            try:
                replay = replay_ideal(run_dir)
            except WhatIfError as e:
                raise ExportError(f"{run_dir}: no ideal replay: {str(e).strip()}") from None
        return _export(run.con, run.meta, out_path, replay)
    finally:
        run.close()


def _export(
    con: duckdb.DuckDBPyConnection, meta: Mapping[str, Any], out_path: str, ideal: Any = None
) -> dict:
    lo, hi = next(_rows(con, "chrome_bounds"))
    origin, end_of_trace = int(lo or 0), int(hi or 0)
    names = _rank_names(con, meta.get("mesh") or {})
    tmp = f"{out_path}.{os.getpid()}.tmp"
    lanes = Lanes()
    stats = {"ranks": len(names), "spans": 0, "collectives": 0, "flows": 0}
    with open(tmp, "w", encoding="utf-8") as f:
        f.write('{"traceEvents":[\n')
        w = Writer(f, origin)
        for rank, label in names.items():
            w.meta("process_name", rank, 0, {"name": label})
            w.meta("process_sort_index", rank, 0, {"sort_index": rank * (2 if ideal else 1)})
        stats["spans"] = _write_spans(con, w, lanes, end_of_trace)
        members = _write_collectives(con, w, lanes, end_of_trace, meta)
        stats["collectives"] = sum(len(m) for m in members.values())
        stats["flows"] = _write_flows(w, members)
        threads = dict(_THREADS)
        if ideal is not None:
            from analyzer.export.chrome_ideal import THREADS, write_ideal

            stats["ideal"] = write_ideal(w, lanes, ideal)
            threads.update(THREADS)
        for (rank, base), ends in lanes.ends.items():
            for i in range(len(ends)):
                title = threads[base] + (f" {i + 1}" if i else "")
                w.meta("thread_name", rank, base + i, {"name": title})
                w.meta("thread_sort_index", rank, base + i, {"sort_index": base + i})
        other = {
            "run_id": meta.get("run_id"),
            "time_origin_ns": origin,
            "mesh": meta.get("mesh"),
            "status": meta.get("status"),
        }
        if ideal is not None:
            other["ideal"] = {
                "pid_offset": ideal.offset(),
                "slowdown": ideal.slowdown,
                "steps": [int(s) for s in ideal.steps],
                "steps_left_out": ideal.left_out,
            }
        f.write(f'\n],"displayTimeUnit":"ms","otherData":{json.dumps(other, default=str)}}}\n')
        stats["events"] = w.count
    os.replace(tmp, out_path)
    return stats
