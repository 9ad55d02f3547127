"""Collectives that bypass the Python API, read from PyTorch's Flight Recorder.

DDP's C++ reducer, functional collectives and DTensor issue their collectives straight to the
process group, where no wrapper of ``torch.distributed`` sees them. Flight Recorder does: every
collective of every process group goes into one ring buffer per process (``TORCH_FR_BUFFER_SIZE``
entries, 2,000 by default in torch 2.13), with its group, ``collective_seq_id``, op, sizes,
dtypes, creation time and state. :class:`FlightReader` reads that buffer in-process at each
flush and turns the entries it has not seen yet into ``collectives`` rows.

Merging with the wrappers' rows: the wrappers number a collective with its group's own sequence
number (``ProcessGroup._get_sequence_number_for_group()`` right after the call, the same number
Flight Recorder records), and note it here; an entry already noted is skipped. Send/recv
entries are always skipped: every Python send/recv goes through the wrappers, which number
them per peer pair. Before reading, the reader compares each group's sequence number with what
the wrappers noted since the last read: when nothing else was issued, the buffer is not read at
all (megascope's own trainer never pays for it).

Times: ``time_created_ns`` (the host clock of the call, in Unix ns) is the issue time, moved to
the tracer's clock. gloo never times its work: an entry is known to have completed (``retired``)
but not when, so its row has ``source`` ``untimed`` and ``start_ns`` = ``end_ns`` = the issue time;
the analyzer estimates how long the rank waited from the other members' arrivals
(docs/spec.md). NCCL entries with a discovered completion (and a device duration when
``TORCH_NCCL_ENABLE_TIMING=1``) have ``source`` ``flight_recorder``. An entry not completed has a
null ``end_ns``; it is written only by a final read (close, hang), so a hang shows who waits where.
"""

from __future__ import annotations

import logging
import pickle
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from typing import Any

from tracer.clock import now_ns
from tracer.opspecs import dtype_bytes, normalize_op, numel

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


def available() -> bool:
    """Whether this torch can dump its Flight Recorder buffer in-process."""
    try:
        import torch._C._distributed_c10d as c10d_c

        return hasattr(c10d_c, "_dump_fr_trace")
    except ImportError:
        return False


class FlightReader:
    """Reads new Flight Recorder entries of one process into ``collectives`` rows.

    ``group_of(pg)`` gives (name, size, key) as the wrappers name groups; ``step_at(ns)`` the
    step that was running at a tracer-clock time; ``skip`` holds process groups that are the
    tracer's own (the clock group).
    """

    def __init__(
        self,
        group_of: Callable[[Any], tuple[str, int, Any]],
        step_at: Callable[[int], int],
        skip: set[Any] | None = None,
    ) -> None:
        import torch._C._distributed_c10d as c10d_c
        import torch.distributed.distributed_c10d as c10d

        self._dump = c10d_c._dump_fr_trace
        self._c10d = c10d
        self._group_of = group_of
        self._step_at = step_at
        self._skip = skip or set()
        self._noted: dict[Any, set[int]] = {}  # pg -> seqs the wrappers recorded, not yet read
        self._p2p: dict[Any, int] = {}  # pg -> its counter's advance by send/recv since the read
        self._read_seq: dict[Any, int] = {}  # pg -> its sequence number at the last read
        self._next_id = 0  # the first record_id not yet settled
        self._open: dict[int, tuple] = {}  # record_id -> row written with a null end
        self._settled: set[int] = set()  # record_ids at or past _next_id already handled
        self._read_once = False
        self._pg_by_name: dict[str, Any] = {}
        self.capacity = _capacity()
        entries = pickle.loads(self._dump(True, False, False)).get("entries") or []
        self._attach_id = int(entries[-1].get("record_id", -1)) + 1 if entries else 0
        self.dropped = 0
        self.rows_read = 0
        self.reads = 0
        self.read_s = 0.0  # time spent reading the buffer (dump and unpickle)
        self.active = True

    # -- called by the wrappers, on the training thread --------------------------------------
    def note(self, pg: Any, first: int, last: int) -> None:
        """A wrapper issued ``pg``'s collectives ``first``..``last``: their entries are
        duplicates of its rows (or its send/recv, which are never read from here)."""
        noted = self._noted.get(pg)
        if noted is None:
            noted = self._noted[pg] = set()
        noted.update(range(first, last + 1))
        if len(noted) > 200_000:  # never read back (buffer off?): do not grow for good
            noted.clear()

    def p2p(self, pg: Any, n: int) -> None:
        """A wrapper's send/recv advanced ``pg``'s counter by ``n`` (gloo counts them there;
        Flight Recorder records none of them)."""
        self._p2p[pg] = self._p2p.get(pg, 0) + n

    def _unexplained(self, pg: Any) -> tuple[int, int]:
        """(new, not the wrappers') sequence numbers of ``pg`` since the last read."""
        new = int(pg._get_sequence_number_for_group()) - self._read_seq.get(pg, 0)
        return new, new - len(self._noted.get(pg, ())) - self._p2p.get(pg, 0)

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
        return bool(self._open)

    def read(self, final: bool = False) -> list[tuple]:
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
        t0 = time.perf_counter()
        dump = pickle.loads(self._dump(True, False, False))
        self.reads += 1
        self.read_s += time.perf_counter() - t0
        delta = now_ns() - time.time_ns()  # Unix ns -> the tracer's clock
        entries = dump.get("entries") or []
        self._pg_by_name.update({name: pg for pg, name in groups.items()})  # kept: see close
        rows: list[tuple] = []
        pending = None
        for entry in entries:
            rid = int(entry.get("record_id", -1))
            if rid in self._settled or (rid < self._next_id and rid not in self._open):
                continue
            row, done = self._row(entry, delta)
            if done:
                self._settled.add(rid)
                if row is not None:
                    self._open.pop(rid, None)  # written open before: now with its end
                    rows.append(row)
            elif row is not None:
                pending = rid if pending is None else pending
                if final and rid not in self._open:
                    self._open[rid] = row
                    rows.append(row)
        if entries:
            first = int(entries[0].get("record_id", 0))
            expected = self._next_id if self._read_once else self._attach_id
            if first > expected:
                self.dropped += first - expected  # the ring wrapped between two reads
            last = int(entries[-1].get("record_id", 0)) + 1
            self._next_id = pending if pending is not None and not final else last
            self._settled = {r for r in self._settled if r >= self._next_id}
        self._read_once = True
        for pg, seq in seqs.items():
            self._read_seq[pg] = seq
            self._p2p[pg] = 0
            noted = self._noted.get(pg)
            if noted:
                noted.difference_update([s for s in noted if s <= seq])
        self.rows_read += len(rows)
        return rows

    def _row(self, entry: dict[str, Any], delta: int) -> tuple[tuple | None, bool]:
        """(row, completed) for one entry; (None, True) for entries that are not ours to write."""
        name = str(entry.get("profiling_name", ""))
        op = fr_op(name)
        if entry.get("is_p2p") or op in ("send", "recv") or op == "coalesced":
            return None, True
        pg_field = entry.get("process_group") or ("", "")
        pg = self._pg_by_name.get(str(pg_field[0]))
        if pg is None:  # a group of the tracer's own, or one this rank no longer knows
            return None, True
        seq = int(entry.get("collective_seq_id") or 0)
        noted = self._noted.get(pg)
        done = bool(entry.get("retired")) or str(entry.get("state", "")) in _DONE_STATES
        if noted is not None and seq in noted:
            if done:
                noted.discard(seq)
            return None, True
        gname, gsize, _ = self._group_of(pg)
        nbytes, dtype = _nbytes(op, entry)
        issue = int(entry.get("time_created_ns") or 0) + delta
        end_c = int(entry.get("time_discovered_completed_ns") or 0)
        duration_ms = entry.get("duration_ms")
        if done and end_c > 0:
            end = end_c + delta
            start = int(end - float(duration_ms) * 1e6) if duration_ms else issue
            start, source = max(start, issue), "flight_recorder"
        elif done:
            start, end, source = issue, issue, "untimed"
        else:
            start, end, source = issue, None, "untimed"
        # step, microbatch, op, group, size, seq, peer, nbytes, dtype, issue, start, end, source
        row = (self._step_at(issue), -1, op, gname, gsize, seq, -1, nbytes, dtype, issue, start,
               end, source)  # fmt: skip
        return row, done


class StepClock:
    """The steps' start times on the tracer's clock, to date entries read later."""

    def __init__(self, keep: int = 4096) -> None:
        self._starts: deque[int] = deque(maxlen=keep)
        self._steps: deque[int] = deque(maxlen=keep)

    def begin(self, ns: int, step: int) -> None:
        self._starts.append(ns)
        self._steps.append(step)

    def step_at(self, ns: int) -> int:
        i = bisect_right(self._starts, ns)
        return self._steps[i - 1] if i > 0 else -1
