"""The Parquet parts of a run's table (docs/spec.md §2): its rank and rank-range folders, the
parts in them, and which of them read as Parquet (an unreadable part is left out with a
warning, so that the rest of the run still reads)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from tracer.rundir import folder_ranks
from tracer.schema import TABLES

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

FULL_PROBE_MAX_FILES = 4096  # past this many folders a table is read by glob, optimistically


def part_is_readable(path: str) -> tuple[str | None, tuple[str, ...]]:
    """(None, column names) when ``path`` reads as Parquet, else (a short reason, ())."""
    try:
        size = os.path.getsize(path)
        if size < 12:
            return f"{size} bytes, too short for Parquet", ()
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(-8, os.SEEK_END)
            tail = f.read(8)
        if head != b"PAR1" or tail[4:] != b"PAR1":
            return "no Parquet magic (truncated or not Parquet)", ()
        if int.from_bytes(tail[:4], "little") + 12 > size:
            return "footer length beyond the file (truncated)", ()
        meta = pq.read_metadata(path)
        return None, tuple(meta.schema.names)
    except (OSError, pa.ArrowException) as e:
        return f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}", ()


def rank_folders(run_dir: str, table: str) -> list[str]:
    """The table's ``rank=NNNNN`` folders (os.scandir: glob costs seconds at 60k files)."""
    try:
        return [e.path for e in os.scandir(os.path.join(run_dir, table)) if e.is_dir()]
    except OSError:
        return []


def range_folders(run_dir: str, table: str) -> list[tuple[str, tuple[int, int]]]:
    """A compacted table's ``ranks=L-H`` folders with their (first, last) ranks."""
    try:
        entries = list(os.scandir(os.path.join(run_dir, table)))
    except OSError:
        return []
    out = []
    for e in entries:
        if e.name.startswith("ranks=") and e.is_dir():
            span = folder_ranks(e.name)
            if span is not None:
                out.append((e.path, span))
    return out


def meets(span: tuple[int, int], wanted: set[int]) -> bool:
    """Whether a folder of ranks ``span`` (first, last) holds one of the ``wanted`` ranks."""
    lo, hi = span
    if lo == hi:
        return lo in wanted
    if hi - lo < len(wanted):
        return any(r in wanted for r in range(lo, hi + 1))
    return any(lo <= r <= hi for r in wanted)


def parts_in(folders: Iterable[str]) -> list[str]:
    """The Parquet parts in ``folders`` (missing folders have none), sorted."""
    files: list[str] = []
    for folder in folders:
        try:
            files += [e.path for e in os.scandir(folder) if e.name.endswith(".parquet")]
        except OSError:
            continue
    return sorted(files)


def good_parts(run_dir: str, table: str, skipped: list[str]) -> tuple[list[str] | None, int, bool]:
    """The table's parts, their number and whether their columns may differ.

    A table of more than ``FULL_PROBE_MAX_FILES`` rank folders is neither listed nor probed
    (``None``, and the number of folders): DuckDB reads it by glob, optimistically.
    """
    folders = rank_folders(run_dir, table)
    if len(folders) > FULL_PROBE_MAX_FILES and not any(c in run_dir for c in "*?[]{}"):
        return None, len(folders), False
    files = parts_in(folders)
    good: list[str] = []
    layouts: set[tuple[str, ...]] = set()
    for path in files:
        reason, names = part_is_readable(path)
        if reason is None:
            good.append(path)
            layouts.add(names)
        else:
            log.warning("skipping unreadable part %s: %s", path, reason)
            skipped.append(path)
    return good, len(good), bool(good) and layouts != {tuple(TABLES[table].names)}


# the tables every traced rank writes from its first flush on: a rank of the world without a
# folder in one of them, where other ranks have one, lost it (or never wrote it)
EVERY_RANK_TABLES = ("heartbeats", "spans")


def ranks_in(run_dir: str, table: str) -> set[int]:
    """The ranks whose rows the table's folders hold (``rank=R`` and compacted ``ranks=L-H``)."""
    held: set[int] = set()
    for folder in rank_folders(run_dir, table):
        span = folder_ranks(os.path.basename(folder))
        if span is not None:
            held.update(range(span[0], span[1] + 1))
    return held


def missing_ranks(run_dir: str, world: int) -> dict[int, list[str]]:
    """Rank -> the tables of :data:`EVERY_RANK_TABLES` with no folder of it, where other ranks
    of the ``world`` have one (a rank folder removed, a rank that never wrote)."""
    out: dict[int, list[str]] = {}
    for table in EVERY_RANK_TABLES:
        held = ranks_in(run_dir, table)
        if not held:
            continue
        for rank in range(world):
            if rank not in held:
                out.setdefault(rank, []).append(table)
    return out


def missing_line(run_dir: str, world: int) -> str | None:
    """One line saying which ranks' folders are missing (None when none is): what a reader
    of the run answers without."""
    text = missing_text(run_dir, world)
    if text is None:
        return None
    return f"{run_dir}: missing the folders of {text}: removed or never written; answering from the rest"


def missing_text(run_dir: str, world: int) -> str | None:
    """Which ranks' folders are missing, as ``rank 2 (heartbeats, spans)`` (None: none is)."""
    missing = missing_ranks(run_dir, world)
    if not missing:
        return None
    by_tables: dict[tuple[str, ...], list[int]] = {}
    for rank, names in sorted(missing.items()):
        by_tables.setdefault(tuple(names), []).append(rank)
    parts = []
    for tables, ranks in by_tables.items():
        shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more"
                                                        if len(ranks) > 8 else "")  # fmt: skip
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {shown} ({', '.join(tables)})")
    return "; ".join(parts)
