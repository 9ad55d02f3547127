"""Digests: the collectives and spans summed per (rank, step, channel), made once, stored.

The detectors' first pass and the dashboard read two small tables instead of the raw rows
(docs/spec.md §2 ``digests``, docs/design.md):

* ``digest_collectives``: one row per (rank, group, peer, is_send, step), made by
  analyzer/sql/digest/collectives.sql from ``collectives_timed``;
* ``digest_spans``: one row per (rank, step), made by analyzer/sql/digest/spans.sql.

Every column is a count, a sum, a minimum or a maximum over one rank's rows, so the digests of
disjoint sets of a rank's rows add up (analyzer/sql/digest/combine_*.sql) to the digests of
their union: the tracer writes them at each flush (tracer/digest.py), synth, the importers and
``compact`` per file of ranks (:func:`write_digests`), and :func:`load_digests` (``open_run``)
reads them back, else computes them once from the raw rows and caches them beside the run
(``RUN/digests.cache.parquet``). Stored digests are used only when they account for every raw
row (their ``n_rows`` add up to the tables' row counts): a run cut between a flush's parts, a
part found unreadable, or a run that grew since its cache was written, is digested again.

Rows of source ``untimed`` (completion known, time not) are summed as recorded: their
estimated waits need the other members' rows, so ``open_run`` digests the collectives of such
a run again from the raw rows where it estimates them (analyzer/db.py ``UNTIMED_MAX_RANKS``).

Library functions (their signatures are kept stable):

* :func:`digest_tables` (raw Parquet parts or Arrow tables of any set of ranks -> the two
  digest tables as Arrow, exactly as ``open_run`` has them);
* :func:`digest_rows` (the two tables -> the stored ``digests`` rows);
* :func:`combine` (stored rows on a connection -> the two digest tables on it);
* :func:`write_digests` (a run directory -> its ``digests`` table, per file of ranks);
* :func:`load_digests` (an opened run -> its digest tables, from disk, cache or raw rows).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any, TypeAlias

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from analyzer.duck import connect, sql_text
from analyzer.parts import parts_in, rank_folders
from analyzer.runview import RunView
from analyzer.table_view import create_table_view, spec_columns
from tracer.rundir import folder_ranks, parquet_options
from tracer.schema import TABLES

log = logging.getLogger(__name__)

KINDS = ("collectives", "spans")  # digest_<kind>
CACHE = "digests.cache.parquet"  # beside run.json: a run's digests made by the analyzer
BATCH_BYTES = 512 << 20  # raw bytes digested together by write_digests (about)
WHOLE = "_whole.json"  # in digests/: written whole, one row per key, in {"files": N} files
# rows per row group of a digests file written whole, which holds its rows in step order: a
# watch's pulse reads one step's rows and skips the row groups that hold other steps
# (analyzer/pulse.py), and DuckDB scans row groups in parallel
ROW_GROUP = 16_384
STEP_ORDER = [("step", "ascending"), ("rank", "ascending")]

Source: TypeAlias = Sequence[str] | pa.Table | None  # Parquet parts, rows, or no rows


def sql(name: str) -> str:
    """The text of analyzer/sql/digest/<name>.sql."""
    return sql_text(f"digest/{name}")


def _raw_view(con: duckdb.DuckDBPyConnection, table: str, source: Source) -> None:
    """A view ``table`` with the table's SPEC columns over ``source`` (a column a part lacks
    reads as null)."""
    schema = TABLES[table]
    if source is None or (not isinstance(source, pa.Table) and not list(source)):
        source = schema.empty_table()
    if isinstance(source, pa.Table):
        rel = con.from_arrow(source)
        rel.select(spec_columns(table, set(rel.columns))).create_view(table, replace=True)
    else:  # as a run's views read them (analyzer/table_view.py)
        create_table_view(con, table, list(source), union=True)


def digest_tables(
    collectives: Source = None,
    spans: Source = None,
    *,
    con: duckdb.DuckDBPyConnection | None = None,
) -> dict[str, pa.Table]:
    """``{"collectives": digest_collectives, "spans": digest_spans}`` of raw rows.

    ``collectives``, ``spans``: Parquet part paths (any set of ranks; give every part of a
    rank, or its rows are digested in parts that :func:`combine` must add up), an Arrow table
    of the table's columns, or None. The same SQL and column types as ``open_run``'s digests;
    untimed rows as recorded (module docstring). ``con``: a DuckDB connection to use (its
    views ``collectives``, ``spans`` and ``collectives_timed`` are replaced), else a new one.
    """
    own = con is None
    con = con or connect()
    try:
        _raw_view(con, "collectives", collectives)
        _raw_view(con, "spans", spans)
        con.execute(
            "create or replace view collectives_timed as "
            "select *, cast(null as bigint) as wait_from_ns from collectives"
        )
        return {k: con.sql(sql(k)).to_arrow_table() for k in KINDS}
    finally:
        if own:
            con.close()


def digest_rows(
    tables: dict[str, pa.Table], con: duckdb.DuckDBPyConnection | None = None
) -> pa.Table:
    """The stored ``digests`` rows (docs/spec.md §2) of :func:`digest_tables`' tables."""
    own = con is None
    con = con or connect()
    try:
        for kind in KINDS:
            con.register(f"digest_{kind}", tables[kind])
        out = con.sql(sql("rows")).to_arrow_table()
        for kind in KINDS:
            con.unregister(f"digest_{kind}")
        return out.cast(TABLES["digests"])
    finally:
        if own:
            con.close()


def combine(
    con: duckdb.DuckDBPyConnection, source: str = "digest_source", *, unique: bool = False
) -> dict[str, Any]:
    """Add stored digests rows up again: the relation ``source`` (a view or table of the
    ``digests`` columns) into the tables ``digest_collectives`` and ``digest_spans`` on
    ``con``. ``unique``: the rows are known to be one per key already (written whole), so
    they are only renamed and typed. Returns the raw rows they account for, by kind."""
    if source != "digest_source":
        con.execute(f"create or replace view digest_source as select * from {source}")
    how = "unique_" if unique else "combine_"
    for kind in KINDS:
        con.execute(f"create or replace table digest_{kind} as {sql(how + kind)}")
    return accounted(con)


def accounted(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """The raw rows the digest tables on ``con`` sum, by kind."""
    return {
        k: int(con.execute(f"select coalesce(sum(n_rows), 0) from digest_{k}").fetchall()[0][0])
        for k in KINDS
    }


# ------------------------------------------------------------------------------ writing


def _units(run_dir: str) -> list[tuple[int, int, list[str], int]]:
    """The run's spans and collectives parts gathered by rank range: (first, last, parts,
    bytes), ranges that overlap merged, in rank order."""
    found: list[tuple[int, int, list[str]]] = []
    for table in KINDS:
        for folder in rank_folders(run_dir, table):
            span = folder_ranks(os.path.basename(folder))
            files = parts_in([folder])
            if span is not None and files:
                found.append((span[0], span[1], files))
    found.sort(key=lambda u: (u[0], u[1]))
    merged: list[tuple[int, int, list[str], int]] = []
    for lo, hi, files in found:
        size = sum(os.path.getsize(f) for f in files)
        if merged and lo <= merged[-1][1]:
            plo, phi, pfiles, psize = merged[-1]
            merged[-1] = (plo, max(phi, hi), pfiles + files, psize + size)
        else:
            merged.append((lo, hi, files, size))
    return merged


def write_digests(run_dir: str, *, batch_bytes: int = BATCH_BYTES) -> int:
    """Write the run's ``digests`` table from its spans and collectives (replacing any), in
    the raw tables' layout: a ``digests/rank=N/`` or ``digests/ranks=L-H/`` folder per folder
    of theirs (folders whose ranges overlap share one), one file each. Consecutive folders of
    about ``batch_bytes`` raw bytes are digested together. The new table is made in a hidden
    folder, then put in place by renames. Returns the files written."""
    batches: list[list[tuple[int, int, list[str], int]]] = []
    size = 0
    for unit in _units(run_dir):
        if not batches or size + unit[3] > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].append(unit)
        size += unit[3]
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    new = os.path.join(run_dir, f".digests-new-{tag}")
    os.makedirs(new)
    con = connect()
    written = 0
    try:
        for batch in batches:
            files = [f for u in batch for f in u[2]]
            tables = digest_tables(
                [f for f in files if _table_of(run_dir, f) == "collectives"],
                [f for f in files if _table_of(run_dir, f) == "spans"],
                con=con,
            )
            rows = digest_rows(tables, con)
            rows = rows.take(pc.sort_indices(rows, [("rank", "ascending")]))
            ranks = rows["rank"].to_numpy()
            for lo, hi, _, _ in batch:
                a, b = np.searchsorted(ranks, [lo, hi + 1])
                name = f"rank={lo:05d}" if lo == hi else f"ranks={lo:05d}-{hi:05d}"
                os.makedirs(os.path.join(new, name))
                path = os.path.join(new, name, "part-000000.parquet")
                part = rows.slice(a, b - a)
                part = part.take(pc.sort_indices(part, STEP_ORDER))
                pq.write_table(
                    part, path, row_group_size=ROW_GROUP, **parquet_options(part.column_names)
                )
                written += 1
    finally:
        con.close()
    with open(os.path.join(new, WHOLE), "w", encoding="utf-8") as f:
        json.dump({"files": written}, f)
    live = os.path.join(run_dir, "digests")
    old = os.path.join(run_dir, f".digests-old-{tag}")
    if os.path.exists(live):
        os.rename(live, old)
    os.rename(new, live)
    shutil.rmtree(old, ignore_errors=True)
    return written


def covers(run_dir: str) -> bool:
    """Whether the run's ``digests`` table accounts for every row of its spans and
    collectives (as :func:`load_digests` requires), read from the files' metadata and the
    digests only."""
    con = connect()
    try:
        for table in (*KINDS, "digests"):
            _raw_view(con, table, parts_in(rank_folders(run_dir, table)))
        if not con.execute("select count(*) from digests").fetchall()[0][0]:
            return False
        got = {
            k: int(
                con.execute(
                    "select coalesce(sum(n_rows), 0) from digests where kind = $k", {"k": k}
                ).fetchall()[0][0]
            )
            for k in KINDS
        }
        return got == {
            k: int(con.execute(f"select count(*) from {k}").fetchall()[0][0]) for k in KINDS
        }
    finally:
        con.close()


def _table_of(run_dir: str, path: str) -> str:
    return os.path.relpath(path, run_dir).split(os.sep)[0]


# ------------------------------------------------------------------------------ reading


def stored_allowed() -> bool:
    """Whether stored digests (the run's table, its cache) may be read and the cache
    written; ``MEGASCOPE_DIGESTS=raw`` digests the raw rows every time (benches, tests)."""
    return os.environ.get("MEGASCOPE_DIGESTS", "") != "raw"


def load_digests(run: RunView) -> str:
    """Make ``digest_collectives`` and ``digest_spans`` on ``run.con``; return where from:
    ``digests`` (the run's table), ``cache`` (``RUN/digests.cache.parquet``) or ``raw`` (the
    raw rows, then cached when the run directory can be written)."""
    con = run.con
    if stored_allowed():
        want = {k: int(run.execute(f"select count(*) as n from {k}")["n"][0]) for k in KINDS}
        if run.has_rows("digests"):
            unique = _whole(run)
            got = run.retrying(lambda: combine(con, "digests", unique=unique))
            if got == want:
                return "digests"
            log.info("%s: stored digests cover %s of %s raw rows; digesting again",
                     run.path, got, want)  # fmt: skip
        cache = os.path.join(run.path, CACHE)
        if os.path.isfile(cache):
            try:
                con.read_parquet(cache).create_view("digest_source", replace=True)
                if combine(con, unique=True) == want:
                    return "cache"
            except duckdb.Error as e:
                log.warning("%s: unreadable (%s); digesting again", cache, str(e).splitlines()[0])
    for kind in KINDS:
        run.create_table(f"digest_{kind}", sql(kind))
    if stored_allowed():
        _write_cache(run)
    return "raw"


def _whole(run: RunView) -> bool:
    """Whether the run's digests table is as :func:`write_digests` wrote it (one row per
    key): its marker names as many files as the run has (folders, where it has too many to
    list; write_digests writes one file per folder)."""
    try:
        with open(os.path.join(run.path, "digests", WHOLE), encoding="utf-8") as f:
            return int(json.load(f)["files"]) == run.parts.get("digests")
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_cache(run: RunView) -> None:
    """Write the run's digests beside it (atomically); a run that cannot be written to is
    analyzed all the same."""
    path = os.path.join(run.path, CACHE)
    tmp = os.path.join(run.path, f".{CACHE}.{os.getpid()}-{uuid.uuid4().hex[:6]}.tmp")
    try:
        rows = run.con.sql(sql("rows")).to_arrow_table().cast(TABLES["digests"])
        rows = rows.take(pc.sort_indices(rows, STEP_ORDER))
        pq.write_table(rows, tmp, row_group_size=ROW_GROUP, **parquet_options(rows.column_names))
        os.replace(tmp, path)
    except OSError as e:
        log.info("%s: digests not cached (%s)", run.path, e)
        try:
            os.remove(tmp)
        except OSError:
            pass
