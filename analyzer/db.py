"""A run directory as a DuckDB database of views (docs/spec.md §2 and §4).

``open_run(path)`` checks the directory, reads ``run.json`` and opens an in-memory DuckDB
connection (two threads, a memory limit) holding:

* one view per SPEC table over the table's Parquet parts, read with ``hive_partitioning=false``
  and ``union_by_name=true`` where the parts' columns differ, projected onto the exact SPEC
  columns (a column a part lacks reads as NULL). A table without parts is an empty view with the same columns and types.
* ``group_members`` (group, gid, rank, size): which ranks form each process group. Group names
  such as ``tp`` name a kind of group, not one group, so collectives are matched across ranks
  by (group, gid, seq). Membership comes from run.json ``groups``, else from the mesh, else
  (an imported trace whose groups run.json does not list) from the ranks that used the group.
* ``rank_coords`` (rank, dp, pp, tp, cp, host), from topology, else from the mesh;
* ``collective_rows`` (analyzer/sql/views/collective_rows.sql): collectives keyed for matching,
  and ``collective_instances`` (views/collective_instances.sql): one row per collective;
* the derived views ``steps`` (analyzer/sql/views/steps.sql) and ``gpu_breakdown``
  (analyzer/sql/gpu_breakdown.sql, when that file exists).

Unreadable Parquet parts (truncated, corrupt, not Parquet) are found before the views are
built: every part's header and footer magic and footer length are checked (a truncated file
fails this), and in tables of at most ``FULL_PROBE_MAX_FILES`` parts each footer is also parsed
with ``pyarrow.parquet.read_metadata`` (which catches garbage inside an intact frame and tells
whether the parts' columns differ). Each bad part is logged once as a warning, listed in
``Run.skipped`` and left out, so the rest of the run still reads.

Past that many parts (a 12,288-rank run has tens of thousands) parsing every footer twice, in
the probe and again for ``union_by_name``, would cost more than the analysis itself: such
tables get the magic check only and ``union_by_name=false`` (every producer writes the exact
SPEC schema through ``tracer.rundir``).
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from tracer.rundir import coords_of, mesh_groups, read_run_json
from tracer.schema import TABLES, table_glob

log = logging.getLogger(__name__)

SQL_DIR = Path(__file__).parent / "sql"
DEFAULT_MEMORY_LIMIT = "3GB"
FULL_PROBE_MAX_FILES = 4096

_DUCK_TYPES = {
    pa.int32(): "integer",
    pa.int64(): "bigint",
    pa.string(): "varchar",
    pa.float32(): "float",
    pa.float64(): "double",
}


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

    def query(self, name: str, **params: Any) -> pd.DataFrame:
        """Run ``analyzer/sql/<name>.sql`` with ``$params`` bound; return a DataFrame."""
        text = sql_text(name)
        return self.con.execute(text, params or None).df()

    def sql(self, text: str) -> pd.DataFrame:
        """Run one SQL statement typed by a user (``megascope sql``)."""
        return self.con.execute(text).df()

    def has_rows(self, table: str) -> bool:
        return self.parts.get(table, 0) > 0

    @property
    def world_size(self) -> int:
        return int(self.meta.get("world_size") or 0)

    @property
    def mesh(self) -> dict[str, int]:
        mesh = self.meta.get("mesh") or {}
        return {k: int(mesh.get(k, 1) or 1) for k in ("dp", "pp", "tp", "cp")}

    def close(self) -> None:
        self.con.close()


def sql_text(name: str) -> str:
    """The text of ``analyzer/sql/<name>.sql``."""
    path = SQL_DIR / f"{name}.sql"
    if not path.is_file():
        raise KeyError(f"no query named {name!r} ({path.name} not found)")
    return path.read_text(encoding="utf-8")


def _part_is_readable(path: str, full: bool) -> tuple[str | None, tuple[str, ...]]:
    """(None, column names) when ``path`` reads as Parquet, else (a short reason, ()).

    The frame check reads 12 bytes; ``full`` also parses the footer (and names the columns).
    """
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
        if not full:
            return None, ()
        meta = pq.read_metadata(path)
        return None, tuple(meta.schema.names)
    except (OSError, pa.ArrowException) as e:
        return f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}", ()


def _good_parts(run_dir: str, table: str, skipped: list[str]) -> tuple[list[str], bool]:
    """The table's readable parts, and whether their columns may differ (union_by_name)."""
    files = sorted(glob.glob(table_glob(run_dir, table)))
    full = len(files) <= FULL_PROBE_MAX_FILES
    good: list[str] = []
    layouts: set[tuple[str, ...]] = set()
    for path in files:
        reason, names = _part_is_readable(path, full)
        if reason is None:
            good.append(path)
            layouts.add(names)
        else:
            log.warning("skipping unreadable part %s: %s", path, reason)
            skipped.append(path)
    uniform = layouts == {tuple(TABLES[table].names)}
    return good, full and not uniform


def _create_table_view(
    con: duckdb.DuckDBPyConnection, table: str, files: list[str], union: bool
) -> None:
    """A view with the table's SPEC columns over ``files`` (an empty view when none)."""
    schema = TABLES[table]
    if not files:
        con.register(f"_empty_{table}", schema.empty_table())
        con.execute(f"create or replace view {table} as select * from _empty_{table}")
        return
    rel = con.read_parquet(files, hive_partitioning=False, union_by_name=union)
    present = set(rel.columns)
    cols = []
    for f in schema:
        source = f'"{f.name}"' if f.name in present else "null"
        cols.append(f'cast({source} as {_DUCK_TYPES[f.type]}) as "{f.name}"')
    rel.select(", ".join(cols)).create_view(table, replace=True)


def _group_members(con: duckdb.DuckDBPyConnection, meta: dict[str, Any]) -> pa.Table:
    """(group, gid, rank, size) for every group used, as explained in the module docstring."""
    listed = [g for g in meta.get("groups") or [] if isinstance(g, dict) and g.get("ranks")]
    if not listed and meta.get("mesh"):
        listed = mesh_groups(meta["mesh"])
    world = int(meta.get("world_size") or 0)
    used = con.execute(
        'select "group", max(group_size), list(distinct rank order by rank) '
        'from collectives group by "group"'
    ).fetchall()
    rows: list[tuple[str, int, int, int]] = []
    names = {str(g["name"]) for g in listed}
    counters: dict[str, int] = {}
    for g in listed:
        name = str(g["name"])
        gid = counters.get(name, 0)
        counters[name] = gid + 1
        ranks = [int(r) for r in g["ranks"]]
        rows += [(name, gid, r, len(ranks)) for r in ranks]
    for name, size, ranks in used:
        if name in names or name is None:
            continue
        members = list(range(world)) if size and world and size >= world else list(ranks)
        rows += [(name, 0, int(r), len(members)) for r in members]
    return pa.table(
        {
            "group": pa.array([r[0] for r in rows], pa.string()),
            "gid": pa.array([r[1] for r in rows], pa.int32()),
            "rank": pa.array([r[2] for r in rows], pa.int32()),
            "size": pa.array([r[3] for r in rows], pa.int32()),
        }
    )


def _coords_table(meta: dict[str, Any], con: duckdb.DuckDBPyConnection) -> pa.Table:
    """(rank, dp, pp, tp, cp, host) for every rank: topology first, else the mesh."""
    topo = con.execute(
        "select rank, any_value(dp), any_value(pp), any_value(tp), any_value(cp), "
        "any_value(host) from topology group by rank"
    ).fetchall()
    known = {int(r[0]): r for r in topo}
    mesh = meta.get("mesh") or {}
    world = int(meta.get("world_size") or 0)
    ranks = sorted(set(range(world)) | set(known))
    cols: dict[str, list[Any]] = {k: [] for k in ("rank", "dp", "pp", "tp", "cp", "host")}
    for r in ranks:
        c = coords_of(r, mesh) if mesh else {"dp": r, "pp": 0, "tp": 0, "cp": 0}
        row = known.get(r)
        if row is not None and row[1] is not None:
            c = {"dp": row[1], "pp": row[2], "tp": row[3], "cp": row[4]}
        cols["rank"].append(r)
        for k in ("dp", "pp", "tp", "cp"):
            cols[k].append(int(c[k] or 0))
        cols["host"].append(row[5] if row is not None else None)
    types = {"host": pa.string()}
    return pa.table({k: pa.array(v, types.get(k, pa.int32())) for k, v in cols.items()})


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
    mesh = meta.get("mesh")
    if mesh is not None and (
        not isinstance(mesh, dict)
        or not all(isinstance(v, int) and v >= 1 for v in mesh.values() if v is not None)
    ):
        raise RunError(f"{where}: mesh {mesh!r} is not a map of axis sizes")
    groups = meta.get("groups")
    if groups is not None and not isinstance(groups, list):
        raise RunError(f"{where}: groups is not a list")


def open_run(path: str | os.PathLike[str], *, memory_limit: str = DEFAULT_MEMORY_LIMIT) -> Run:
    """Open a run directory for analysis. Raises :class:`RunError` (one line) when unusable."""
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
    # Spill to the system's temp folder, never into the working directory (DuckDB's default).
    spill = os.path.join(tempfile.gettempdir(), f"megascope-duckdb-{os.getpid()}")
    con = duckdb.connect(
        ":memory:",
        config={"threads": 2, "memory_limit": memory_limit, "temp_directory": spill},
    )
    con.execute("set parquet_metadata_cache = true")  # every detector scans the same parts
    run = Run(path=run_dir, meta=meta, con=con)
    try:
        _create_views(run)
    except duckdb.Error as e:
        con.close()
        raise RunError(f"{run_dir}: unreadable tables ({str(e).strip().splitlines()[0]})") from None
    return run


def _create_views(run: Run) -> None:
    """Every view of the module docstring, on ``run.con``."""
    con, run_dir, meta = run.con, run.path, run.meta
    for table in TABLES:
        files, union = _good_parts(run_dir, table, run.skipped)
        run.parts[table] = len(files)
        _create_table_view(con, table, files, union)
    con.register("_group_members", _group_members(con, meta))
    con.execute("create or replace view group_members as select * from _group_members")
    con.register("_rank_coords", _coords_table(meta, con))
    con.execute("create or replace view rank_coords as select * from _rank_coords")
    for view in ("collective_rows", "collective_instances", "steps"):
        con.execute(f"create or replace view {view} as {sql_text('views/' + view)}")
    if (SQL_DIR / "gpu_breakdown.sql").is_file():
        try:
            con.execute(f"create or replace view gpu_breakdown as {sql_text('gpu_breakdown')}")
        except duckdb.Error as e:
            log.warning("gpu_breakdown view not created: %s", str(e).splitlines()[0])
