"""The tracer's buffers and its background Parquet writer.

The hot path appends one tuple per row to a :class:`Buffer` (a plain list: appending is atomic
under the GIL, no lock, no Arrow). The flusher thread drains a buffer by slicing off the rows
present when it looked (``del rows[:n]`` is atomic too, so a row appended meanwhile stays for
the next flush), turns them into columns, resolves timestamps, and writes one Parquet part per
table per flush through :func:`tracer.rundir.write_part` (zstd, temporary name then rename).

Timestamps in rows are either ints (local host ns), None (not known, e.g. a collective that had
not completed), or CUDA events not yet resolved. :func:`to_columns` converts them to rank 0's
clock; rows whose events have not completed are deferred to the next flush.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracer import rundir
from tracer.schema import TABLES

log = logging.getLogger(__name__)

# Columns of each table's rows, in order: the table's columns without ``rank``.
ROW_COLUMNS: dict[str, tuple[str, ...]] = {
    name: tuple(f.name for f in schema if f.name != "rank") for name, schema in TABLES.items()
}
TIME_COLUMNS: dict[str, tuple[str, ...]] = {
    "topology": (),
    "spans": ("start_ns", "end_ns"),
    "collectives": ("issue_ns", "start_ns", "end_ns"),
    "gpu": ("ts_ns",),
    "heartbeats": ("ts_ns",),
    "stacks": ("ts_ns",),
    "work": (),
    "digests": (),
}
_DEFER = object()
# Compaction (PartWriter.compact): comp files merged together once there are this many, and
# never again once one is this large.
COMP_FANIN = 4
SEAL_BYTES = 64 << 20


class Buffer:
    """Rows of one table between flushes; over ``cap`` rows, new rows are dropped and counted."""

    __slots__ = ("rows", "cap", "dropped")

    def __init__(self, cap: int) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.cap = cap
        self.dropped = 0

    def add(self, row: tuple[Any, ...]) -> None:
        """Hold ``row``, or count it as dropped when the buffer is full."""
        if len(self.rows) < self.cap:
            self.rows.append(row)
        else:
            self.dropped += 1

    def drain(self) -> list[tuple[Any, ...]]:
        """Take the rows held now; a row added meanwhile stays for the next drain."""
        n = len(self.rows)
        out = self.rows[:n]
        del self.rows[:n]
        return out


def to_columns(
    table: str,
    rows: list[tuple[Any, ...]],
    rank: int,
    offset_ns: int,
    resolve: Callable[[Any], int | None] | None,
) -> tuple[dict[str, list[Any]], list[tuple[Any, ...]]]:
    """Rows as the table's columns on rank 0's clock, plus the rows deferred to a later flush.

    ``resolve`` turns a CUDA event into local host ns, None while it has not completed (the
    row waits for the next flush), or -1 when the caller gave up on it (written as null).
    """
    names = ROW_COLUMNS[table]
    time_idx = [names.index(c) for c in TIME_COLUMNS[table]]
    deferred: list[tuple[Any, ...]] = []
    ready = rows
    if resolve is not None and any(  # CUDA events only where there is a timer to resolve them
        type(r[i]) is not int and r[i] is not None for i in time_idx for r in rows
    ):
        ready = []  # CUDA events among the times: resolve them row by row
        for row in rows:
            fixed = list(row)
            for i in time_idx:
                fixed[i] = _fix(fixed[i], offset_ns, resolve)
            if any(fixed[i] is _DEFER for i in time_idx):
                deferred.append(row)
            else:
                ready.append(tuple(fixed))
        offset = 0  # applied by _fix
    else:
        offset = offset_ns  # host times only (every CPU run): a column at a time
    columns: dict[str, list[Any]] = {"rank": [rank] * len(ready)}
    width = min((len(r) for r in ready), default=len(names))
    full = list(zip(*ready, strict=False)) if ready else [()] * width  # what every row fills
    for i, name in enumerate(names):
        if i in time_idx and offset:
            columns[name] = [None if v is None else v + offset for v in full[i]]
        elif i < width:
            columns[name] = list(full[i])
        else:  # a trailing optional column some rows leave out (a span's transfer fields)
            columns[name] = [r[i] if i < len(r) else None for r in ready]
    return columns, deferred


def _fix(value: Any, offset_ns: int, resolve: Callable[[Any], int | None] | None) -> Any:
    if value is None:
        return None
    if isinstance(value, int):
        return value + offset_ns
    if resolve is None:
        return None
    ns = resolve(value)
    if ns is None:
        return _DEFER
    return None if ns < 0 else ns + offset_ns


class PartWriter:
    """Writes one rank's parts, numbering them per table; remembers the first failure."""

    def __init__(self, run_dir: str, rank: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self._next: dict[str, int] = {}
        self._next_comp: dict[str, int] = {}
        self.bytes_written = 0
        self.rows_written = 0

    def compact(self, table: str, min_parts: int) -> str | None:
        """Merge this rank's small files of ``table`` into one ``comp-*`` file.

        Each Parquet file carries a footer of a few KiB, so a long run of small flushes would
        cost tens of bytes per row, and a reader opening the run pays for every footer. Two
        levels keep the count of files per (table, rank) small at any time:

        * the ``part-*`` files are merged into a new ``comp-*`` once there are at least
          ``min_parts`` of them (``flush`` passes ``compact_parts``; the close passes 2);
        * the ``comp-*`` files under :data:`SEAL_BYTES` are merged along once there would be
          :data:`COMP_FANIN` of them, and always at the close (``min_parts`` <= 2), so a run
          that ends cleanly leaves one file per (table, rank), or a few past ``SEAL_BYTES``.

        A comp file of ``SEAL_BYTES`` or more is never rewritten, which bounds the work of a
        long run: a rank's table is rewritten at most every ``COMP_FANIN`` merges, and never
        past that size. The merged file is complete (written and renamed) before the inputs are
        deleted: a reader in that instant, or a crash between the two, sees rows twice, never
        loses any (readers fold a collective flushed twice, docs/tracer.md).
        """
        directory = rundir.rank_dir(self.run_dir, table, self.rank)
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            return None
        final = min_parts <= 2
        parts = [n for n in names if n.startswith("part-") and n.endswith(".parquet")]
        comps = []
        for n in names:
            if n.startswith("comp-") and n.endswith(".parquet"):
                try:
                    small = os.path.getsize(os.path.join(directory, n)) < SEAL_BYTES
                except OSError:
                    continue
                if small:
                    comps.append(n)
        merge_parts = len(parts) >= max(2, min_parts) or bool(final and parts and comps)
        inputs = list(parts) if merge_parts else []
        if comps and (final or (merge_parts and len(comps) + 1 >= COMP_FANIN)):
            inputs = comps + inputs
        if len(inputs) < 2:
            return None
        paths = [os.path.join(directory, n) for n in inputs]
        merged = pa.concat_tables([rundir.to_table(table, pq.read_table(p)) for p in paths])
        if table not in self._next_comp:
            self._next_comp[table] = _next_index(directory, "comp-")
        part = self._next_comp[table]
        out = rundir.write_part(self.run_dir, table, self.rank, merged, part=part, prefix="comp")
        self._next_comp[table] = part + 1
        for p in paths:
            os.remove(p)
        return out

    def write(self, table: str, columns: dict[str, list[Any]]) -> str | None:
        """Write a part (nothing when there are no rows). Raises OSError when writing fails, and
        FileNotFoundError when the table's folder, written before, has vanished since (it is
        not made again: whoever removed it wanted it gone)."""
        if not columns["rank"]:
            return None
        directory = rundir.rank_dir(self.run_dir, table, self.rank)
        if table in self._next and not os.path.isdir(directory):
            # written before, gone now (a rank folder or the run removed): never re-created
            raise FileNotFoundError(errno.ENOENT, "the folder vanished", directory)
        if table not in self._next:
            self._next[table] = rundir.next_part_index(directory)
        part = self._next[table]
        path = rundir.write_part(self.run_dir, table, self.rank, columns, part=part)
        self._next[table] = part + 1
        self.rows_written += len(columns["rank"])
        try:
            self.bytes_written += os.path.getsize(path)
        except OSError:
            pass
        return path


def _next_index(directory: str, prefix: str) -> int:
    best = -1
    for name in os.listdir(directory):
        stem = name[len(prefix) : -len(".parquet")]
        if name.startswith(prefix) and name.endswith(".parquet") and stem.isdigit():
            best = max(best, int(stem))
    return best + 1


def preload() -> None:
    """Import now what the first flush and the first merge of parts would import in the middle
    of training (Arrow's query engine for the digests' group-bys, its datasets for reading parts
    back: about a tenth of a second of one core), so that attach pays for it, before step 0."""
    import pyarrow.acero  # noqa: F401
    import pyarrow.dataset  # noqa: F401


class Flusher:
    """A daemon thread calling ``flush()`` every ``every_s`` seconds (a number, or a function
    read before each wait: the tracer's budget widens it) or when asked to.

    ``request()`` is what ``tracer.step`` calls every N steps: it only sets an event, so the
    training thread never waits for Parquet, nor for a disk that stalls: while a write hangs,
    rows go on into the bounded buffers, and past their cap are dropped with a count.
    ``stop()`` runs no flush: it ends the thread (after the flush in progress, if any) and waits
    up to its timeout; the last flush is the caller's (``tracer.lifecycle.finish``).
    """

    def __init__(
        self, flush: Callable[[], None], every_s: float | Callable[[], float], name: str
    ) -> None:
        self._flush = flush
        self._every = every_s if callable(every_s) else (lambda: every_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Ask for a flush now (it only sets an event)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(max(0.05, self._every()))
            self._wake.clear()
            if self._stop.is_set():
                break
            self._flush()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it (unless called from it)."""
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
