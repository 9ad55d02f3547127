"""A finished run rewritten as a few large files per table (``megascope compact RUN``, whose
command is analyzer/commands/compact.py).

The tracer writes each rank's rows into its own folder, ``TABLE/rank=NNNNN/``: at 12,288 ranks
that is 61k files, and opening the run costs a footer per file. ``compact`` rewrites every
table as a few folders ``TABLE/ranks=LLLLL-HHHHH/part-000000.parquet`` (docs/spec.md §2), each
holding the rows of a contiguous range of ranks, sorted by rank, step and time (collectives by
kind of channel first, ``group``: dp, pp, tp...), in row groups
of DuckDB's size (122,880 rows: its unit of parallel scanning). The rows are the same, so every
query reads the same answer; a reader that wants a few ranks (``Run.restricted``, the what-if's
batches) reads the folders whose range holds them and skips the other ranks' row groups by
their statistics.

Safety: the new tables are written into a hidden folder of the run (``RUN/.compact-*``),
their row counts checked against the old ones, then each table folder is exchanged with its
new version in one rename (``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere two renames, and
a later ``compact`` finishes a swap cut in between). A run whose run.json says ``running`` is
refused unless ``--force`` (its ranks are still writing), and so is a run with unreadable parts
(they would be left out of the new files). Another ``compact`` of the same run at the same time
is refused by a lock file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field

from analyzer.digests import covers, write_digests
from analyzer.table_view import spec_columns
from tracer.rundir import folder_ranks, read_run_json
from tracer.schema import TABLES

log = logging.getLogger("megascope.compact")

ROW_GROUP_ROWS = 122_880  # DuckDB's row group size: its unit of parallel scanning
DEFAULT_FILE_MB = 256  # input bytes gathered into one output file (about)
LOCK = ".compact.lock"
TMP_PREFIX = ".compact-"
_ORDER = {  # the sort of a compacted table: rank, step, time
    "topology": ("rank", "clock_offset_ns"),
    "spans": ("rank", "step", "start_ns", "end_ns", "microbatch", "name"),
    # by kind of channel first: no row group mixes kinds but at the boundaries, so a reader of
    # one kind (the data-parallel rows of a group: Run.restricted) skips the others' row groups
    "collectives": ('"group"', "rank", "step", "issue_ns", "seq", "op"),
    "gpu": ("rank", "ts_ns"),
    "heartbeats": ("rank", "ts_ns", "step"),
    "stacks": ("rank", "ts_ns", "thread"),
    "work": ("rank", "step", "microbatch", "kind", "key", '"group"', "seq"),
    "digests": ("rank", "step", "kind", '"group"', "peer", "is_send", "n_rows"),
}


class CompactError(ValueError):
    """A run that cannot be compacted; the message is one line."""


@dataclass
class Unit:
    """A table folder: the ranks it holds, its Parquet files and their bytes."""

    lo: int
    hi: int
    files: list[str]
    nbytes: int
    name: str = ""


@dataclass
class TableResult:
    """What compacting did to one table: its files and bytes before and after, and the rows written
    (``skipped``: it was compact already)."""

    table: str
    files_before: int = 0
    files_after: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    rows: int = 0
    skipped: bool = False  # already compact


@dataclass
class Result:
    """What :func:`compact` did: the run, each table's :class:`TableResult` and the seconds it
    took."""

    run_dir: str
    tables: list[TableResult] = field(default_factory=list)
    seconds: float = 0.0


# ------------------------------------------------------------------------------ the library


def compact(run_dir: str, *, force: bool = False, file_mb: float = DEFAULT_FILE_MB) -> Result:
    """Compact ``run_dir`` in place (module docstring). Raises :class:`CompactError`."""
    t_start = time.monotonic()
    run_dir = os.path.abspath(run_dir)
    if not os.path.exists(run_dir):
        raise CompactError(f"{run_dir}: no such directory")
    if not os.path.isdir(run_dir):
        raise CompactError(f"{run_dir}: not a directory")
    try:
        meta = read_run_json(run_dir)
    except ValueError as e:
        raise CompactError(str(e).splitlines()[0]) from None
    if meta.get("status") == "running" and not force:
        raise CompactError(
            f"{run_dir}: run.json says the run is still running (its ranks may still be "
            "writing); wait for it to end, or pass --force if it is dead"
        )
    if file_mb <= 0:
        raise CompactError(f"--file-mb must be positive, got {file_mb}")
    result = Result(run_dir)
    with _Lock(run_dir):
        _recover(run_dir)
        plans = {t: _units(run_dir, t) for t in TABLES}
        bad = _unreadable(plans)
        if bad and not force:
            raise CompactError(
                f"{run_dir}: {len(bad)} unreadable parts (first: {bad[0]}) would be left out; "
                "pass --force to compact without them"
            )
        tmp = os.path.join(run_dir, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}")
        new_root = os.path.join(tmp, "new")
        os.makedirs(new_root)
        done: list[str] = []
        try:
            con = _connect()
            try:
                for table, units in plans.items():
                    res = TableResult(table)
                    result.tables.append(res)
                    units = [_drop(u, bad) for u in units]
                    units = [u for u in units if u.files]
                    res.files_before = sum(len(u.files) for u in units)
                    res.bytes_before = sum(u.nbytes for u in units)
                    if not units:
                        continue
                    if _already_compact(units):
                        res.skipped, res.files_after = True, res.files_before
                        res.bytes_after = res.bytes_before
                        continue
                    out = os.path.join(new_root, table)
                    _write_table(con, table, units, out, file_mb, res)
                    done.append(table)
            finally:
                con.close()
            _write_marker(os.path.join(tmp, "READY"), done)
            for table in done:
                _swap(os.path.join(run_dir, table), os.path.join(new_root, table))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not covers(run_dir):  # a run without digests (or short of rows) gets them
            write_digests(run_dir)
    result.seconds = time.monotonic() - t_start
    return result


def _connect():
    from analyzer.duck import connect

    return connect()


def _units(run_dir: str, table: str) -> list[Unit]:
    """The table's folders (``rank=N`` and ``ranks=L-H``), by first rank."""
    units: list[Unit] = []
    try:
        entries = list(os.scandir(os.path.join(run_dir, table)))
    except OSError:
        return units
    for e in entries:
        if not e.is_dir():
            continue
        span = folder_ranks(e.name)
        if span is None:
            raise CompactError(
                f"{e.path}: not a rank folder (rank=N or ranks=L-H); not a megascope table"
            )
        files, nbytes = [], 0
        for f in os.scandir(e.path):
            if f.name.endswith(".parquet") and not f.name.startswith("."):
                files.append(f.path)
                nbytes += f.stat().st_size
        units.append(Unit(span[0], span[1], sorted(files), nbytes, e.name))
    return sorted(units, key=lambda u: (u.lo, u.hi))


def _unreadable(plans: dict[str, list[Unit]]) -> list[str]:
    from analyzer.parts import part_is_readable

    bad = []
    for units in plans.values():
        for u in units:
            bad += [f for f in u.files if part_is_readable(f)[0] is not None]
    return bad


def _drop(unit: Unit, bad: list[str]) -> Unit:
    if not bad:
        return unit
    files = [f for f in unit.files if f not in set(bad)]
    return Unit(unit.lo, unit.hi, files, sum(os.path.getsize(f) for f in files), unit.name)


def _already_compact(units: list[Unit]) -> bool:
    """A table that ``compact`` wrote: ``ranks=L-H`` folders of one file each."""
    return all(len(u.files) == 1 and u.name.startswith("ranks=") for u in units)


def _groups(units: list[Unit], file_mb: float) -> list[list[Unit]]:
    """Consecutive units gathered into groups of about ``file_mb`` MiB of input; units whose
    ranges overlap always share a group, so the groups' ranges never overlap."""
    target = file_mb * 2**20
    groups: list[list[Unit]] = []
    size, hi = 0, -1
    for u in units:
        if groups and (u.lo <= hi or size < target):
            groups[-1].append(u)
            size += u.nbytes
        else:
            groups.append([u])
            size = u.nbytes
        hi = max(hi, u.hi)
    return groups


def _write_table(con, table: str, units: list[Unit], out: str, file_mb: float,
                 res: TableResult) -> None:  # fmt: skip
    """Write the table's new folders under ``out``; check that every row is there."""
    order = ", ".join(_ORDER[table])
    for group in _groups(units, file_mb):
        lo, hi = min(u.lo for u in group), max(u.hi for u in group)
        files = [f for u in group for f in u.files]
        rel = con.read_parquet(files, hive_partitioning=False, union_by_name=True)
        cols = spec_columns(table, set(rel.columns))
        folder = os.path.join(out, f"ranks={lo:05d}-{hi:05d}")
        os.makedirs(folder)
        path = os.path.join(folder, "part-000000.parquet")
        con.execute(
            f"copy (select {cols} from read_parquet($files, hive_partitioning=false, "
            f"union_by_name=true) order by {order}) to '{_sql_str(path)}' "
            f"(format parquet, compression zstd, row_group_size {ROW_GROUP_ROWS})",
            {"files": files},
        )
        n_in = con.execute(
            "select count(*) from read_parquet($files, hive_partitioning=false, "
            "union_by_name=true)",
            {"files": files},
        ).fetchone()[0]
        n_out, lo_r, hi_r = con.execute(
            "select count(*), min(rank), max(rank) from read_parquet($f)", {"f": path}
        ).fetchone()
        if n_out != n_in:
            raise CompactError(f"{path}: {n_out} rows written for {n_in} read; nothing changed")
        if n_out and (lo_r < lo or hi_r > hi):
            raise CompactError(
                f"{table}: rows of ranks {lo_r}..{hi_r} in the folders of ranks {lo}..{hi} "
                "(a rank folder holds another rank's rows); nothing changed"
            )
        res.rows += n_in
        res.files_after += 1
        res.bytes_after += os.path.getsize(path)


def _sql_str(text: str) -> str:
    return text.replace("'", "''")


def _write_marker(path: str, tables: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"tables": tables}, f)
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------ the swap

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _swap(live: str, new: str) -> None:
    """Put ``new`` in place of ``live``; ``live``'s old content ends up at ``new``."""
    if not os.path.exists(live):
        os.rename(new, live)
        return
    fn = _renameat2()
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(live), _AT_FDCWD, os.fsencode(new), _RENAME_EXCHANGE)
        if rc == 0:
            return
        # EINVAL/ENOSYS: a file system without the exchange; fall through to two renames
    old = new + ".old"
    os.rename(live, old)
    os.rename(new, live)
    os.rename(old, new)


def _recover(run_dir: str) -> None:
    """Finish or undo what an interrupted ``compact`` left (``RUN/.compact-*``)."""
    for entry in os.scandir(run_dir):
        if not (entry.name.startswith(TMP_PREFIX) and entry.is_dir()):
            continue
        ready = os.path.join(entry.path, "READY")
        if os.path.exists(ready):
            with open(ready, encoding="utf-8") as f:
                tables = json.load(f).get("tables", [])
            for table in tables:  # a swap cut between its two renames: the table is missing
                live = os.path.join(run_dir, table)
                if os.path.exists(live):
                    continue
                for cand in ("new/" + table, "new/" + table + ".old"):
                    src = os.path.join(entry.path, cand)
                    if os.path.isdir(src):
                        os.rename(src, live)
                        log.warning("restored %s from an interrupted compact", live)
                        break
        shutil.rmtree(entry.path, ignore_errors=True)


class _Lock:
    """``RUN/.compact.lock``, created exclusively: one compact of a run at a time."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK)

    def __enter__(self) -> _Lock:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._stale():
                    os.remove(self.path)
                    continue
                raise CompactError(
                    f"{self.path}: another compact of this run is under way (remove the file "
                    "if it is not)"
                ) from None
            except OSError as e:
                raise CompactError(f"{self.path}: cannot write ({e.strerror})") from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(info, f)
            return self
        raise CompactError(f"{self.path}: cannot take the lock")

    def _stale(self) -> bool:
        """A lock left by a process of this host that is gone."""
        try:
            with open(self.path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            return False
        if info.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
        return False

    def __exit__(self, *exc: object) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
