"""A run's rows read back from its Parquet files with DuckDB, as the analyzer reads them."""

from __future__ import annotations

import duckdb

from tracer.config import TracerConfig

# a tracer that neither watches for hangs nor flushes until it closes
QUIET = TracerConfig(hang_timeout_s=0, flush_every_s=60)


def read(run: str, table: str, where: str = "true") -> list[dict]:
    rel = duckdb.sql(
        f"select * from read_parquet('{run}/{table}/*/*.parquet', hive_partitioning=false) "
        f"where {where} order by all"
    )
    cols = rel.columns
    return [dict(zip(cols, row, strict=True)) for row in rel.fetchall()]


def assert_seq_matches(rows: list[dict]) -> None:
    """Every (group, seq) of a collective has one op and one size on all its members."""
    by_key: dict[tuple, set] = {}
    members: dict[tuple, set] = {}
    for r in rows:
        if r["peer"] >= 0:
            continue
        key = (r["group"], r["seq"])
        by_key.setdefault(key, set()).add((r["op"], r["nbytes"], r["group_size"]))
        members.setdefault(key, set()).add(r["rank"])
    assert by_key, "no collectives recorded"
    for key, variants in by_key.items():
        assert len(variants) == 1, f"{key}: {variants}"
        size = next(iter(variants))[2]
        assert len(members[key]) == size, f"{key} seen on {members[key]}, group of {size}"
