"""DuckDB as every reader of a run opens it: one connection factory, and the SQL of analyzer/sql/
by name.

A connection has two threads (the machines it runs on share their cores with training), a
memory limit past which it spills to the system's temp folder (never the working directory,
DuckDB's default), Parquet footers cached across the queries that scan the same parts again,
and no progress bar. analyzer/db.py opens runs with it; the digests, the what-if's batches,
compact and a watch's pulse open their own connections with it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import duckdb

SQL_DIR = Path(__file__).parent / "sql"
DEFAULT_MEMORY_LIMIT = "3GB"
# Where reading every raw row stops: past EXACT_MAX_RANKS ranks the analysis matches collectives
# only in the groups it suspects and reads per-step sums from the digests (a watch too); the
# dashboard, which answers while someone waits, draws its rank x step views from the digests
# past DRAW_EXACT_MAX_RANKS (sums of spans there, not unions of their intervals).
EXACT_MAX_RANKS = 1024
DRAW_EXACT_MAX_RANKS = 256


def sql_text(name: str, root: Path = SQL_DIR) -> str:
    """The text of ``analyzer/sql/<name>.sql`` (``name`` such as ``findings/rank_compute``), or
    of ``<root>/<name>.sql`` for a package that keeps its own SQL (the dashboard's)."""
    path = root / f"{name}.sql"
    if not path.is_file():
        raise KeyError(f"no query named {name!r} ({path.name} not found)")
    return path.read_text(encoding="utf-8")


def connect(
    memory_limit: str = DEFAULT_MEMORY_LIMIT, threads: int = 2
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection set up as the module docstring says."""
    spill = os.path.join(tempfile.gettempdir(), f"megascope-duckdb-{os.getpid()}")
    con = duckdb.connect(
        ":memory:",
        config={"threads": threads, "memory_limit": memory_limit, "temp_directory": spill},
    )
    con.execute("set parquet_metadata_cache = true")
    con.execute("set enable_progress_bar = false")
    return con
