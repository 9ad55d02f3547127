"""A SPEC table as a DuckDB view over its Parquet parts, projected onto the table's columns.

A column a part lacks reads as NULL, and a table without parts is an empty view with the same
columns and types, so every query of analyzer/sql/ binds on any run, whatever wrote it.
``spec_columns`` is that projection; the digests and ``compact`` read raw parts through it too.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from analyzer.membership import int_list
from tracer.schema import TABLES

DUCK_TYPES = {
    pa.int32(): "integer",
    pa.int64(): "bigint",
    pa.string(): "varchar",
    pa.float32(): "float",
    pa.float64(): "double",
}


def create_table_view(
    con: duckdb.DuckDBPyConnection,
    table: str,
    files: list[str],
    union: bool,
    ranks: frozenset[int] | None = None,
    pattern: str | None = None,
    where: str | list[str] | None = None,
    *,
    view: str | None = None,
    filename: bool = False,
) -> None:
    """A view with the table's SPEC columns over ``files`` (an empty view when none).

    ``union``: the parts' columns differ, so they are read by name. ``ranks``: keep only these
    ranks' rows (a restricted run over files of a compacted run, which hold many ranks each:
    the files are sorted by rank, so DuckDB skips the row groups of other ranks by their
    statistics). ``pattern``, a glob, is read instead of ``files`` when given (a table too
    large to list: binding a view over a list of 12,288 paths costs a quarter of a second per
    use). ``where``: a further filter on the rows (SQL), or filters whose rows are disjoint,
    read apart and put together (each pushed into its own scan). ``view``: the view's name
    (default: the table's); ``filename``: keep DuckDB's ``filename`` column too (which part a
    row came from: a watch's pulse follows each part's newest step).
    """
    schema = TABLES[table]
    name = view or table
    if not files and not pattern:
        con.register(f"_empty_{table}", schema.empty_table())
        extra = ", null::varchar as filename" if filename else ""
        con.execute(f"create or replace view {name} as select *{extra} from _empty_{table}")
        return
    rel = con.read_parquet(
        pattern or files, hive_partitioning=False, union_by_name=union, filename=filename
    )
    present = set(rel.columns)
    if ranks is not None:
        rel = rel.filter(f"rank in ({int_list(ranks)})")
    if isinstance(where, list):
        merged: duckdb.DuckDBPyRelation | None = None
        for w in where:
            part = rel.filter(w)
            merged = part if merged is None else merged.union(part)
        if merged is None:
            raise ValueError(f"{table}: an empty list of filters")
        rel = merged
    elif where is not None:
        rel = rel.filter(where)
    columns = spec_columns(table, present) + (", filename" if filename else "")
    rel.select(columns).create_view(name, replace=True)


def spec_columns(table: str, present: set[str]) -> str:
    """The select list of ``table``'s SPEC columns, in order, each cast to its type: a column
    missing from ``present`` (the source's columns) reads as NULL."""
    cols = []
    for f in TABLES[table]:
        source = f'"{f.name}"' if f.name in present else "null"
        cols.append(f'cast({source} as {DUCK_TYPES[f.type]}) as "{f.name}"')
    return ", ".join(cols)
