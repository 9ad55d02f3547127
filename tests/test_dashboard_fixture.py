"""The dashboard's small run (helpers/small_run.py) is readable as written."""

from __future__ import annotations

from helpers.small_run import write_small_run


def test_small_run_is_readable(tmp_path):
    import duckdb

    run = write_small_run(str(tmp_path / "r"), {"dp": 2, "pp": 2, "tp": 2}, steps=3, slow_rank=5)
    got = duckdb.sql(
        f"select rank, sum(end_ns - start_ns) from read_parquet('{run}/spans/*/*.parquet', "
        "hive_partitioning=false) where kind = 'compute' group by rank order by 2 desc"
    ).fetchall()
    assert got[0][0] == 5 and len(got) == 8
