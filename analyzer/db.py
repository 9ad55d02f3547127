"""A run directory as a DuckDB database of views (docs/spec.md §2 and §4).

``open_run(path)`` checks the directory, reads ``run.json`` and opens an in-memory DuckDB
connection (two threads, a memory limit) holding:

* one view per SPEC table over the table's Parquet parts, read with ``hive_partitioning=false``
  and ``union_by_name=true`` where the parts' columns differ, projected onto the exact SPEC
  columns (a column a part lacks reads as NULL). A table without parts is an empty view with the same columns and types.
* the digests (analyzer/digests.py): two small tables, one row per (rank, step) and channel,
  that the detectors and the dashboard read instead of the raw rows (12,288 ranks: 59M
  collective rows, 3M digest rows), from the run's ``digests`` table, its cache, or the rows;
* ``group_members`` (group, gid, rank, size): which ranks form each process group. Group names
  such as ``tp`` name a kind of group, not one group, so collectives are matched across ranks
  by (group, gid, seq). Membership comes from run.json ``groups``, else from the mesh, else
  (an imported trace whose groups run.json does not list) from the ranks that used the group;
* ``rank_coords`` (rank, dp, pp, tp, cp, host), from run.json ``coords`` (a script's own
  DeviceMesh), else topology, else the mesh. An attached script's run without either has its
  layout read from its process groups first (analyzer/meshinfer.py: ``meta`` then holds the
  ``mesh`` and ``coords`` they tell, and ``layout``, how);
* ``collectives_timed``: the collectives with the end of each ``untimed`` row (its completion
  known, not its time: gloo's collectives read from Flight Recorder) estimated from the other
  members' arrivals (analyzer/sql/digest/untimed_waits.sql), on runs of at most
  ``UNTIMED_MAX_RANKS``; the digests and ``collective_rows`` read it;
* ``collective_rows`` (analyzer/sql/views/collective_rows.sql): collectives keyed for matching,
  and ``collective_instances`` (views/collective_instances.sql): one row per collective;
* the derived views ``steps`` (analyzer/sql/views/steps.sql), and ``gpu_breakdown`` and
  ``comm_overlap`` (HTA's temporal breakdown and overlap, analyzer/sql/gpu_breakdown.sql and
  comm_overlap.sql, over the window of analyzer/sql/gpu_window.sql).

Matching collectives across ranks is the one costly step (a hash join of every row of every
member); :meth:`Run.restricted` opens the same views over a subset of ranks' folders, so a
detector at scale matches only the groups it suspects, plus a few for reference.

Unreadable Parquet parts (truncated, corrupt, not Parquet) are left out with one warning each
and listed in ``Run.skipped``, so the rest of the run still reads. In tables of at most
``FULL_PROBE_MAX_FILES`` parts every footer is parsed up front with
``pyarrow.parquet.read_metadata`` (which also tells whether the parts' columns differ). Past
that (a 12,288-rank run has tens of thousands of parts, and parsing every footer costs more
than the analysis), the parts are read optimistically: when DuckDB fails on a part, its error
names the file, which is left out, and the query runs again.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import duckdb
import pandas as pd
import pyarrow as pa

from analyzer import meshinfer
from analyzer.digests import load_digests
from analyzer.duck import DEFAULT_MEMORY_LIMIT, SQL_DIR, connect, sql_text
from analyzer.membership import (
    complete_channels,
    coords_table,
    group_members_table,
)
from analyzer.parts import (
    good_parts,
    meets,
    parts_in,
    range_folders,
    rank_folders,
)
from analyzer.table_view import create_table_view
from tracer.rundir import (
    MAX_WORLD,
    MeshError,
    folder_ranks,
    mesh_sizes,
    read_run_json,
)
from tracer.schema import TABLES, rank_dir, table_glob

T = TypeVar("T")

log = logging.getLogger(__name__)

MAX_BAD_PARTS = 1000  # optimistic reading gives up past this many unreadable parts
RESTRICTED_KEPT = 8  # restricted runs kept open per run (each is a DuckDB connection)
GPU_VIEWS = ("gpu_window", "gpu_breakdown", "comm_overlap")  # over spans, in this order
DIGESTS = ("collectives", "spans")
UNTIMED_MAX_RANKS = 1024  # past this, untimed collectives count as no wait (matching costs)

_NONE = " limit 0"  # a digest's columns and types, without rows
DigestHook = Callable[["Run"], dict[str, pa.Table]]
_QUOTED = re.compile(r"'([^']+)'|\"([^\"]+)\"")


class RunError(Exception):
    """A run directory that cannot be analyzed; the message is one line."""


@dataclass
class Run:
    """An opened run: its metadata, its DuckDB connection and what was skipped."""

    path: str
    meta: dict[str, Any]
    con: duckdb.DuckDBPyConnection
    skipped: list[str] = field(default_factory=list)
    parts: dict[str, int] = field(default_factory=dict)
    files: dict[str, list[str] | None] = field(default_factory=dict)  # None: too many to list
    union: dict[str, bool] = field(default_factory=dict)
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    ranks: frozenset[int] | None = None  # a restricted run's ranks (None: all)
    where: dict[str, str | list[str]] = field(default_factory=dict)  # restricted: row filters
    derived: dict[str, pa.Table] = field(default_factory=dict)  # group_members, rank_coords
    digests_from: str = ""  # where the digests came from (analyzer/digests.py load_digests)
    _restricted: dict[tuple[frozenset[int], bool], Run] = field(default_factory=dict, repr=False)

    def query(self, name: str, **params: Any) -> pd.DataFrame:
        """Run ``analyzer/sql/<name>.sql`` with ``$params`` bound; return a DataFrame."""
        return self.execute(sql_text(name), params or None)

    def sql(self, text: str) -> pd.DataFrame:
        """Run one SQL statement typed by a user (``megascope sql``)."""
        return self.execute(text)

    def execute(self, text: str, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """Run ``text``; a part found unreadable on the way is left out and the query retried."""
        return self.retrying(lambda: self.con.execute(text, params).df())

    def create_table(self, name: str, text: str) -> None:
        """``create or replace table name as text``, retried like :meth:`execute`."""
        self.retrying(lambda: self.con.execute(f"create or replace table {name} as {text}"))

    def retrying(self, fn: Callable[[], T]) -> T:
        """``fn()``, run again after each unreadable part it meets is left out (at most
        ``MAX_BAD_PARTS``)."""
        for _ in range(MAX_BAD_PARTS):
            try:
                return fn()
            except duckdb.Error as e:
                if not self.drop_bad_part(str(e)):
                    raise
        raise RunError(f"{self.path}: more than {MAX_BAD_PARTS} unreadable parts")

    def drop_bad_part(self, message: str) -> bool:
        """Leave out the part a DuckDB error names, if it is one of ours; whether it was.
        (A reader with its own connection over :meth:`table_files`, the what-if's, calls it
        where its query fails, then lists the files again.)"""
        for m in _QUOTED.finditer(message):
            bad = m.group(1) or m.group(2)
            for table in TABLES:
                if not bad.startswith(os.path.join(self.path, table) + os.sep):
                    continue
                files = self.files.get(table)
                if files is None:  # read by glob so far: list the parts now
                    files = parts_in(rank_folders(self.path, table))
                    files = [f for f in files if f not in self.skipped]
                if bad not in files:
                    continue
                first = message.strip().splitlines()[0]
                log.warning("skipping unreadable part %s: %s", bad, first)
                self.skipped.append(bad)
                files.remove(bad)
                self.files[table], self.parts[table] = files, len(files)
                create_table_view(
                    self.con,
                    table,
                    files,
                    self.union.get(table, False),
                    self._filter(files),
                    where=self.where.get(table),
                )
                return True
        return False

    def ensure_frontier(self) -> None:
        """Make ``digest_frontier`` (analyzer/sql/digest/frontier.sql) unless it exists: a
        scan of every collective, needed only where a run did not finish cleanly."""
        exists = self.con.execute(
            "select count(*) from duckdb_tables() where table_name = 'digest_frontier'"
        ).fetchall()[0][0]
        if not exists:
            self.create_table("digest_frontier", sql_text("digest/frontier"))

    def has_rows(self, table: str) -> bool:
        """Whether ``table`` has a readable part."""
        return self.parts.get(table, 0) > 0

    def table_files(self, table: str) -> list[str]:
        """Every readable part of ``table``: those listed at open, or (a table read by glob,
        too many parts to probe) the parts found now, less those left out so far."""
        files = self.files.get(table, [])
        if files is None:
            return [p for p in parts_in(rank_folders(self.path, table)) if p not in self.skipped]
        return list(files)

    def rank_files(self, table: str, ranks: Iterable[int]) -> list[str]:
        """The table's readable parts that hold rows of ``ranks``: their ``rank=NNNNN``
        folders, and the ``ranks=LLLLL-HHHHH`` folders of a compacted run whose range holds
        one of them (those files hold other ranks' rows too: see :meth:`_filter`)."""
        wanted = set(ranks)
        files = self.files.get(table, [])
        if files is None:  # not listed (too many): list the folders of these ranks only
            folders = [rank_dir(self.path, table, r) for r in wanted]
            folders += [f for f, span in range_folders(self.path, table) if meets(span, wanted)]
            found = parts_in(folders)
            return [p for p in found if p not in self.skipped]
        out = []
        for path in files:
            span = folder_ranks(os.path.basename(os.path.dirname(path)))
            if span is None or meets(span, wanted):
                out.append(path)
        return out

    def _filter(self, files: list[str]) -> frozenset[int] | None:
        """The ranks a restricted run's views keep, where some of its ``files`` hold other
        ranks' rows too (a compacted run's ``ranks=L-H`` folders); None: no filter needed."""
        if self.ranks is None:
            return None
        for path in files:
            span = folder_ranks(os.path.basename(os.path.dirname(path)))
            if span is not None and span[0] != span[1]:
                return self.ranks
        return None

    def restricted(self, ranks: Iterable[int], *, complete: bool = False) -> Run:
        """The same run with the collectives and spans of ``ranks`` only (its own connection).

        Collective instances whose members are all in ``ranks`` read exactly as in the whole
        run; ``group_members`` and ``rank_coords`` are the whole run's. With ``complete``,
        those are the only collectives it holds: a rank's rows in a group that has members
        outside ``ranks``, or of a send/recv with a rank outside them, are left out (matching
        the groups of a rank whose data-parallel group has 384 members then costs those
        members' data-parallel rows, not all their rows). The last ``RESTRICTED_KEPT`` rank
        sets stay open for reuse and close with this run.
        """
        keep = frozenset(int(r) for r in ranks)
        key = (keep, complete)
        if key in self._restricted:
            return self._restricted[key]
        if len(self._restricted) >= RESTRICTED_KEPT:
            self._restricted.pop(next(iter(self._restricted))).close()
        self._restricted[key] = sub = self._open_restricted(keep, complete)
        return sub

    def _open_restricted(self, keep: frozenset[int], complete: bool) -> Run:
        con = connect(self.memory_limit)
        sub = Run(path=self.path, meta=self.meta, con=con, memory_limit=self.memory_limit)
        sub.ranks = keep
        if complete:
            sub.where["collectives"] = complete_channels(self.derived["group_members"], keep)
        for table in TABLES:
            files = self.rank_files(table, keep) if table in DIGESTS else []
            sub.files[table], sub.parts[table] = files, len(files)
            sub.union[table] = self.union.get(table, False)
            create_table_view(
                con,
                table,
                files,
                sub.union[table],
                sub._filter(files),
                where=sub.where.get(table),
            )
        sub.derived = dict(self.derived)
        _create_timed_view(con, estimated=False)
        _create_derived_views(con, sub.derived, ("collective_rows", "collective_instances"))
        return sub

    @property
    def world_size(self) -> int:
        """run.json's ``world_size`` (0 when it has none)."""
        return int(self.meta.get("world_size") or 0)

    @property
    def mesh(self) -> dict[str, int]:
        """run.json's mesh as ``{axis: size}``."""
        return mesh_sizes(self.meta.get("mesh") or {})  # checked at open (_check_meta)

    def close(self) -> None:
        """Close the connection, and those of the restricted runs made from this one."""
        for sub in self._restricted.values():
            sub.close()
        self._restricted.clear()
        self.con.close()


def _check_meta(run_dir: str, meta: dict[str, Any]) -> None:
    """Reject a run.json whose keys the analyzer relies on have the wrong shape."""
    where = f"{run_dir}/run.json"
    try:
        world = int(meta.get("world_size") or 0)
    except (TypeError, ValueError):
        raise RunError(
            f"{where}: world_size {meta.get('world_size')!r} is not an integer"
        ) from None
    if world < 0:
        raise RunError(f"{where}: world_size {world} is negative")
    if world > MAX_WORLD:  # a bad number: reading its ranks would take hours, not seconds
        raise RunError(
            f"{where}: world_size {world} is more than the {MAX_WORLD} ranks megascope takes"
        )
    mesh = meta.get("mesh")
    if mesh is not None and (
        not isinstance(mesh, dict)
        or not all(isinstance(v, int) and v >= 1 for v in mesh.values() if v is not None)
    ):
        raise RunError(f"{where}: mesh {mesh!r} is not a map of axis sizes")
    try:
        mesh_sizes(mesh or {})
    except MeshError as e:
        raise RunError(f"{where}: {e}") from None
    groups = meta.get("groups")
    if groups is not None and not isinstance(groups, list):
        raise RunError(f"{where}: groups is not a list")


def _create_derived_views(
    con: duckdb.DuckDBPyConnection, tables: dict[str, pa.Table], views: Iterable[str]
) -> None:
    """Views over the Arrow ``tables`` (group_members, rank_coords), then the ``views`` of
    analyzer/sql/views/ built on them."""
    for name, table in tables.items():
        con.register(f"_{name}", table)
        con.execute(f"create or replace view {name} as select * from _{name}")
    for view in views:
        con.execute(f"create or replace view {view} as {sql_text('views/' + view)}")


def _create_timed_view(con: duckdb.DuckDBPyConnection, *, estimated: bool) -> None:
    """``collectives_timed``: the collectives with the ends of `untimed` rows estimated (from
    the table ``untimed_waits``), or as they are."""
    name = "collectives_timed" if estimated else "collectives_timed_plain"
    con.execute(f"create or replace view collectives_timed as {sql_text('views/' + name)}")


def _has_untimed(run: Run) -> bool:
    """Whether the run has collectives whose completion time is unknown (gloo's, read from
    Flight Recorder), on a run small enough to match them across ranks up front."""
    if run.world_size > UNTIMED_MAX_RANKS or not run.parts.get("collectives"):
        return False
    found = run.execute("select 1 from collectives where source = 'untimed' limit 1")
    return not found.empty


def open_run(path: str | os.PathLike[str], *, memory_limit: str = DEFAULT_MEMORY_LIMIT,
             digests: DigestHook | None = None, tables_only: bool = False) -> Run:  # fmt: skip
    """Open a run directory for analysis. Raises :class:`RunError` (one line) when unusable.
    ``digests(run)``: digests made elsewhere by name (analyzer/executor.py), as Arrow tables.
    ``tables_only``: the SPEC tables' views alone (what the what-if and the exports read),
    with no digests or derived views to make."""
    run_dir = os.fspath(path)
    if not os.path.exists(run_dir):
        raise RunError(f"{run_dir}: no such directory")
    if not os.path.isdir(run_dir):
        raise RunError(f"{run_dir}: not a directory")
    if not os.listdir(run_dir):
        raise RunError(f"{run_dir}: empty directory (not a megascope run)")
    try:
        meta = read_run_json(run_dir)
    except ValueError as e:
        raise RunError(str(e).splitlines()[0]) from None
    _check_meta(run_dir, meta)
    con = connect(memory_limit)
    run = Run(path=run_dir, meta=meta, con=con, memory_limit=memory_limit)
    try:
        if tables_only:
            _create_table_views(run)
        else:
            _create_views(run, digests)
    except duckdb.Error as e:
        con.close()
        raise RunError(f"{run_dir}: unreadable tables ({str(e).strip().splitlines()[0]})") from None
    return run


def _create_table_views(run: Run) -> None:
    """One view per SPEC table over its readable parts, on ``run.con``."""
    for table in TABLES:
        files, parts, union = good_parts(run.path, table, run.skipped)
        run.files[table], run.parts[table], run.union[table] = files, parts, union
        if files is None:
            create_table_view(run.con, table, [], union, pattern=table_glob(run.path, table))
        else:
            create_table_view(run.con, table, files, union)


def _create_views(run: Run, digests: DigestHook | None) -> None:
    """Every view and digest of the module docstring, on ``run.con``."""
    con = run.con
    _create_table_views(run)
    _create_timed_view(con, estimated=False)
    made = digests(run) if digests is not None else {}
    if not made:  # stored digests, else made from the raw rows and cached (analyzer/digests.py)
        run.digests_from = load_digests(run)
    for table in DIGESTS if made else ():
        run.create_table(f"digest_{table}", sql_text(f"digest/{table}") + _NONE * (table in made))
        if table in made:  # typed as its SQL makes it, filled with the rows made elsewhere
            run.con.register("_made", made[table])
            run.con.execute(f"insert into digest_{table} by name select * from _made")
            run.con.unregister("_made")
    meshinfer.apply(run)  # an attached script's layout, from its process groups
    run.derived["group_members"] = group_members_table(run)
    run.derived["rank_coords"] = coords_table(run)
    views = ("collective_rows", "collective_instances", "steps", "rank_step_sums")
    _create_derived_views(con, run.derived, views)
    if _has_untimed(run):
        run.create_table("untimed_waits", sql_text("digest/untimed_waits"))
        _create_timed_view(con, estimated=True)
        run.create_table("digest_collectives", sql_text("digest/collectives"))
    for view in GPU_VIEWS:  # HTA's window, then its temporal breakdown and overlap
        if (SQL_DIR / f"{view}.sql").is_file():
            try:
                con.execute(f"create or replace view {view} as {sql_text(view)}")
            except duckdb.Error as e:
                log.warning("%s view not created: %s", view, str(e).splitlines()[0])
