"""Collectives that bypass the Python API, read from PyTorch's Flight Recorder.

DDP's C++ reducer, functional collectives and DTensor issue their collectives straight to the
process group, where no wrapper of ``torch.distributed`` sees them. Flight Recorder does: every
collective of every process group goes into a ring buffer per process (``TORCH_FR_BUFFER_SIZE``
entries, 2,000 by default), with its group, ``collective_seq_id``, op, sizes, dtypes, creation
time and state. Releases of 2025-2026 keep two such rings: the generic one (gloo) and NCCL's own
(``_dump_nccl_trace``); PyTorch's main branch routes every backend through one. :class:`FlightReader`
reads every ring this torch has, in-process, at each flush, and turns the entries it has not
seen yet into ``collectives`` rows: a collective found in two rings (one recorder under two
names) is written once, by its group and sequence number.

Merging with the wrappers' rows: the wrappers number a collective with its group's own sequence
number (``ProcessGroup._get_sequence_number_for_group()`` right after the call, the same number
Flight Recorder records), and note it here; an entry already noted is skipped. Send/recv
entries are always skipped: every Python send/recv goes through the wrappers, which number
them per peer pair. Before reading, the reader compares each group's sequence number with what
the wrappers noted since the last read: when nothing else was issued, the rings are not read
at all (megascope's own trainer never pays for it), and a ring that wrapped loses nothing that
matters. Lost entries are counted only when the counters say that collectives no wrapper saw
went missing.

Times: ``time_created_ns`` (the host clock of the call, in Unix ns) is the issue time, moved to
the tracer's clock. gloo never times its work: an entry is known to have completed (``retired``)
but not when, so its row has ``source`` ``untimed`` and ``start_ns`` = ``end_ns`` = the issue time;
the analyzer estimates how long the rank waited from the other members' arrivals
(docs/spec.md). NCCL entries with a discovered completion have ``source`` ``flight_recorder``:
the end is when NCCL's watchdog found the work complete (an upper bound), and with
``TORCH_NCCL_ENABLE_TIMING=1`` (or :func:`enable_nccl_timing`) the start is the end less the
device's own duration (``duration_ms``, from CUDA events). An entry still in flight is read
again at the next read, and written once complete; a final read (close, hang) writes it with a
null ``end_ns``, so a hang shows who waits where.
"""

from __future__ import annotations

import functools
import logging
import pickle
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from typing import Any

from tracer.clock import EPOCH_OFFSET_NS, unix_offset_ns
from tracer.opspecs import dtype_bytes, normalize_op, numel
from tracer.schema import C, make_row

log = logging.getLogger(__name__)

_DONE_STATES = ("completed",)


def fr_op(profiling_name: str) -> str:
    """The SPEC op of a Flight Recorder ``profiling_name`` (``nccl:_allgather_base`` ->
    ``all_gather``); unknown names keep their text after the backend prefix."""
    raw = profiling_name.split(":", 1)[-1].strip().split(" ")[0].lower()
    return normalize_op(profiling_name) or raw or "unknown"


def _nbytes(op: str, entry: dict[str, Any]) -> tuple[int, str]:
    """Bytes by nccl-tests' conventions (the full array for all_gather and reduce_scatter)."""
    use = "output" if op == "all_gather" else "input"
    sizes = entry.get(f"{use}_sizes") or []
    dtypes = entry.get(f"{use}_dtypes") or entry.get("input_dtypes") or []
    total = 0
    for shape, dt in zip(sizes, dtypes, strict=False):
        total += numel(list(shape or ())) * (dtype_bytes(dt) or 4)
    dtype = str(dtypes[0]).lower() if dtypes else ""
    return total, {"float": "float32", "long": "int64", "int": "int32", "half": "float16"}.get(
        dtype, dtype
    )


RETIRE_WAIT_S = 1.0  # a final read waits this long at most for completed work to retire


def _retired(entry: dict[str, Any]) -> bool:
    """Whether an entry is finished for good. NCCL's watchdog retires a work it found complete
    and only then records its device duration and the time it found it; a dump taken before
    that says ``completed`` with the dump's own time as the discovery, so such an entry is
    read again later. A recorder without ``retired`` is read by its state."""
    if "retired" in entry:
        return bool(entry["retired"])
    return str(entry.get("state", "")) in _DONE_STATES


def _unretired(entries: list[dict[str, Any]], since: int) -> bool:
    """Whether some entry at or past record id ``since`` completed and is not retired yet."""
    return any(
        int(e.get("record_id", -1)) >= since
        and str(e.get("state", "")) in _DONE_STATES
        and not e.get("retired", True)
        for e in entries
    )


def _capacity() -> int:
    """The ring's size, as torch reads it (``TORCH_FR_BUFFER_SIZE``, formerly
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``; 2,000 when unset)."""
    import os

    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return 2000


def sources() -> list[tuple[str, Callable[[], bytes]]]:
    """The Flight Recorder rings this torch can dump in-process, as (name, dump).

    Releases of 2025-2026 keep two recorders: the generic one (``_dump_fr_trace``: gloo, and
    any backend routed through it) and NCCL's own (``_dump_nccl_trace``: what NCCL's process
    groups record, with device durations when ``TORCH_NCCL_ENABLE_TIMING=1``). PyTorch's main
    branch routes every backend through one recorder; where both names dump the same ring, the
    reader counts each collective once all the same (by its group and sequence number)."""
    try:
        import torch._C._distributed_c10d as c10d_c
    except ImportError:
        return []
    out: list[tuple[str, Callable[[], bytes]]] = []
    for name, attr in (("generic", "_dump_fr_trace"), ("nccl", "_dump_nccl_trace")):
        dump = getattr(c10d_c, attr, None)
        if dump is not None:  # (collectives, no stack traces, not only the active ones)
            out.append((name, functools.partial(dump, True, False, False)))
    return out


def available() -> bool:
    """Whether this torch can dump a Flight Recorder ring in-process."""
    return bool(sources())


def enable_nccl_timing(groups: list[Any]) -> int:
    """Turn on NCCL's device timing of every collective (what ``TORCH_NCCL_ENABLE_TIMING=1``
    does for groups made after it is set) on the groups made before the tracer attached.
    Returns how many groups took it; a group whose backend has no such switch is left alone."""
    n = 0
    for pg in groups:
        switch = getattr(pg, "_enable_collectives_timing", None)
        if switch is None:
            continue
        try:
            switch()
            n += 1
        except Exception:
            continue
    return n


class _Ring:
    """One recorder's ring buffer, and what of it has been read: record ids number its entries
    from 0 on, one numbering per ring."""

    def __init__(self, name: str, dump: Callable[[], bytes]) -> None:
        self.name = name
        self.dump = dump
        entries = self.entries()
        self.next_id = int(entries[-1].get("record_id", -1)) + 1 if entries else 0  # unsettled
        self.open: dict[int, tuple[Any, ...]] = {}  # record_id -> row written with a null end
        self.settled: set[int] = set()  # record_ids at or past next_id already handled
        self.pending = False  # an entry in flight at the last read

    def entries(self) -> list[dict[str, Any]]:
        return pickle.loads(self.dump()).get("entries") or []


class FlightReader:
    """Reads new Flight Recorder entries of one process into ``collectives`` rows.

    ``group_of(pg)`` gives (name, size, key) as the wrappers name groups; ``step_at(ns)`` the
    step that was running at a tracer-clock time; ``skip`` holds process groups that are the
    tracer's own (the clock group); ``rings`` the (name, dump) of each ring to read (default:
    :func:`sources`).
    """

    def __init__(
        self,
        group_of: Callable[[Any], tuple[str, int, Any]],
        step_at: Callable[[int], int],
        skip: set[Any] | None = None,
        rings: list[tuple[str, Callable[[], bytes]]] | None = None,
    ) -> None:
        import torch.distributed.distributed_c10d as c10d

        self._c10d = c10d
        self._group_of = group_of
        self._step_at = step_at
        self._skip = skip or set()
        self._noted: dict[Any, set[int]] = {}  # pg -> seqs the wrappers recorded, not yet read
        self._p2p: dict[Any, int] = {}  # pg -> its counter's advance by send/recv since the read
        self._read_seq: dict[Any, int] = {}  # pg -> its sequence number at the last read
        self._taken: dict[Any, set[int]] = {}  # pg -> seqs already read from some ring
        self._pg_by_name: dict[str, Any] = {}
        self.capacity = _capacity()
        self.rings: list[_Ring] = []
        for name, dump in sources() if rings is None else rings:
            try:
                self.rings.append(_Ring(name, dump))
            except Exception as exc:  # a recorder this build lists but cannot dump
                log.info("megascope: Flight Recorder's %s ring is not readable: %s", name, exc)
        self.dropped = 0  # entries nobody else recorded that the ring lost before a read
        self.rows_read = 0
        self.timed = 0  # rows with the device's own duration (NCCL's timing)
        self.reads = 0
        self.read_s = 0.0  # time spent reading the rings (dump and unpickle)
        self.active = bool(self.rings)

    # -- called by the wrappers, on the training thread --------------------------------------
    def note(self, pg: Any, first: int, last: int) -> None:
        """A wrapper issued ``pg``'s collectives ``first``..``last``: their entries are
        duplicates of its rows (or its send/recv, which are never read from here)."""
        noted = self._noted.get(pg)
        if noted is None:
            noted = self._noted[pg] = set()
        if first == last:
            noted.add(first)
        else:
            noted.update(range(first, last + 1))
        if len(noted) > 200_000:  # never read back (buffer off?): do not grow for good
            noted.clear()

    def p2p(self, pg: Any, n: int) -> None:
        """A wrapper's send/recv advanced ``pg``'s counter by ``n`` (gloo counts them there;
        Flight Recorder records none of them)."""
        self._p2p[pg] = self._p2p.get(pg, 0) + n

    def _unexplained(self, pg: Any, seq: int | None = None) -> tuple[int, int]:
        """(new, not the wrappers') sequence numbers of ``pg`` since the last read, up to
        ``seq`` (default: its counter now)."""
        last = self._read_seq.get(pg, 0)
        if seq is None:  # the wrappers note seqs past the last read only
            seq, noted = int(pg._get_sequence_number_for_group()), len(self._noted.get(pg, ()))
        else:
            noted = sum(1 for s in self._noted.get(pg, ()) if last < s <= seq)
        new = seq - last
        return new, new - noted - self._p2p.get(pg, 0)

    # -- called by the flusher ----------------------------------------------------------------
    def _groups(self) -> dict[Any, str]:
        names = dict(self._c10d._world.pg_names)
        return {pg: name for pg, name in names.items() if pg not in self._skip}

    def backlog(self) -> bool:
        """Whether to read before the next flush: entries not read yet fill half the ring and
        some of them are not the wrappers' (a long flush interval would lose them)."""
        total = unnoted = 0
        for pg in self._groups():
            try:
                new, other = self._unexplained(pg)
            except Exception:
                continue
            total += new
            unnoted += max(0, other)
        return unnoted > 0 and total > self.capacity // 2

    def due(self) -> bool:
        """Whether some group issued a collective that no wrapper recorded since the last read."""
        for pg in self._groups():
            try:
                if self._unexplained(pg)[1] > 0:
                    return True
            except Exception:
                return True
        return any(ring.open or ring.pending for ring in self.rings)

    def read(self, final: bool = False) -> list[tuple[Any, ...]]:
        """Rows for the entries not read yet (completed ones; with ``final`` also the rest,
        with a null end). Returns [] when nothing is due (a cheap check, no dump)."""
        if not self.active or not (final or self.due()):
            return []
        groups = self._groups()
        seqs = {}
        for pg in groups:
            try:
                seqs[pg] = int(pg._get_sequence_number_for_group())
            except Exception:
                pass
        self._pg_by_name.update({name: pg for pg, name in groups.items()})  # kept: see close
        expected = {pg: max(0, self._unexplained(pg, seq)[1]) for pg, seq in seqs.items()}
        seen: dict[Any, set[int]] = {}
        rows: list[tuple[Any, ...]] = []
        gap = 0
        for ring in self.rings:
            t0 = time.perf_counter()
            entries = ring.entries()
            if final:  # at close: give the watchdog a moment to time what just completed
                deadline = time.monotonic() + RETIRE_WAIT_S
                while _unretired(entries, ring.next_id) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    entries = ring.entries()
            self.read_s += time.perf_counter() - t0
            delta = EPOCH_OFFSET_NS - unix_offset_ns()  # Unix ns -> the tracer's clock
            rows += self._read_ring(ring, entries, delta, final, seqs, seen)
            if entries and int(entries[0].get("record_id", 0)) > ring.next_id:
                gap += int(entries[0].get("record_id", 0)) - ring.next_id  # the ring wrapped
            self._advance(ring, entries, final)
        self.reads += 1
        if gap:  # lost: what the counters say was issued outside the wrappers and no ring held
            missing = sum(max(0, n - len(seen.get(pg, ()))) for pg, n in expected.items())
            self.dropped += min(gap, missing)
        for pg, seq in seqs.items():
            self._read_seq[pg] = seq
            self._p2p[pg] = 0
            noted = self._noted.get(pg)
            if noted:
                noted.difference_update([s for s in noted if s <= seq])
            taken = self._taken.get(pg)
            if taken and len(taken) > 4 * self.capacity:
                floor = seq - 2 * self.capacity
                taken.difference_update([s for s in taken if s < floor])
        self.rows_read += len(rows)
        return rows

    def _read_ring(
        self,
        ring: _Ring,
        entries: list[dict[str, Any]],
        delta: int,
        final: bool,
        seqs: dict[Any, int],
        seen: dict[Any, set[int]],
    ) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = []
        for entry in entries:
            rid = int(entry.get("record_id", -1))
            if rid in ring.settled or (rid < ring.next_id and rid not in ring.open):
                continue
            row, done, pg, seq = self._row(entry, delta)
            if pg is not None and self._read_seq.get(pg, 0) < seq <= seqs.get(pg, -1):
                seen.setdefault(pg, set()).add(seq)
            if done:
                ring.settled.add(rid)
                if row is not None:
                    ring.open.pop(rid, None)  # written open before: now with its end
                    self._taken.setdefault(pg, set()).add(seq)
                    self.timed += row[C.source] == "flight_recorder" and bool(
                        entry.get("duration_ms")
                    )
                    rows.append(row)
            elif row is not None and final and rid not in ring.open:
                ring.open[rid] = row
                rows.append(row)
        return rows

    def _advance(self, ring: _Ring, entries: list[dict[str, Any]], final: bool) -> None:
        """The first record id still to look at: the oldest one in flight, unless final."""
        if not entries:
            return
        pending = None
        if not final:
            for entry in entries:
                rid = int(entry.get("record_id", -1))
                if rid >= ring.next_id and rid not in ring.settled:
                    pending = rid
                    break
        last = int(entries[-1].get("record_id", 0)) + 1
        ring.pending = pending is not None  # read again at the next flush
        ring.next_id = pending if pending is not None else last
        ring.settled = {r for r in ring.settled if r >= ring.next_id}

    def _row(
        self, entry: dict[str, Any], delta: int
    ) -> tuple[tuple[Any, ...] | None, bool, Any, int]:
        """(row, completed, pg, seq) for one entry; row None for entries that are not ours to
        write (send/recv, the tracer's own groups, what the wrappers or another ring gave)."""
        name = str(entry.get("profiling_name", ""))
        op = fr_op(name)
        if entry.get("is_p2p") or op in ("send", "recv") or op == "coalesced":
            return None, True, None, 0
        pg_field = entry.get("process_group") or ("", "")
        pg = self._pg_by_name.get(str(pg_field[0]))
        if pg is None:  # a group of the tracer's own, or one this rank no longer knows
            return None, True, None, 0
        seq = int(entry.get("collective_seq_id") or 0)
        noted = self._noted.get(pg)
        done = _retired(entry)
        if noted is not None and seq in noted:
            if done:
                noted.discard(seq)
            return None, True, None, 0
        if seq in self._taken.get(pg, ()):  # the same collective, from the other ring
            return None, True, pg, seq
        gname, gsize, _ = self._group_of(pg)
        nbytes, dtype = _nbytes(op, entry)
        issue = int(entry.get("time_created_ns") or 0) + delta
        end_c = int(entry.get("time_discovered_completed_ns") or 0)
        duration_ms = entry.get("duration_ms")
        if done and end_c > 0:
            # the watchdog discovers a completion after it happened: the end is an upper
            # bound, and with NCCL's timing the device's own duration places the start
            end = end_c + delta
            start = end - round(float(duration_ms) * 1e6) if duration_ms else issue
            start, source = max(start, issue), "flight_recorder"
        elif done:
            start, end, source = issue, issue, "untimed"
        else:
            start, end, source = issue, None, "untimed"
        row = make_row("collectives", step=self._step_at(issue), microbatch=-1, op=op,
                       group=gname, group_size=gsize, seq=seq, peer=-1, nbytes=nbytes,
                       dtype=dtype, issue_ns=issue, start_ns=start, end_ns=end, source=source)  # fmt: skip
        return row, done, pg, seq


class StepClock:
    """The steps' start times on the tracer's clock, to date entries read later."""

    def __init__(self, keep: int = 4096) -> None:
        self._starts: deque[int] = deque(maxlen=keep)
        self._steps: deque[int] = deque(maxlen=keep)

    def begin(self, ns: int, step: int) -> None:
        """Step ``step`` began at ``ns``."""
        self._starts.append(ns)
        self._steps.append(step)

    def step_at(self, ns: int) -> int:
        """The step running at ``ns`` (-1: before the first remembered)."""
        i = bisect_right(self._starts, ns)
        return self._steps[i - 1] if i > 0 else -1
