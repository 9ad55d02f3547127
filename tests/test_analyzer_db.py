"""analyzer.db: opening a run directory, its views, and what it does with bad input."""

from __future__ import annotations

import json
import logging
import os

import pytest
from helpers.world import World, write_world

from analyzer.db import RunError, open_run
from tracer.schema import TABLES


@pytest.fixture(scope="module")
def world_run(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("world"))
    write_world(World(steps=5), path)
    return path


def test_missing_empty_and_garbage_inputs_raise_one_line(tmp_path):
    cases = {
        str(tmp_path / "nope"): "no such directory",
        str(tmp_path): "empty directory",
    }
    for path, fragment in cases.items():
        with pytest.raises(RunError, match=fragment) as e:
            open_run(path)
        assert "\n" not in str(e.value)
    (tmp_path / "spans").mkdir()
    with pytest.raises(RunError, match="no run.json"):
        open_run(tmp_path)
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(RunError, match="not valid JSON") as e:
        open_run(tmp_path)
    assert "\n" not in str(e.value)
    (tmp_path / "run.json").write_text("[1, 2]")
    with pytest.raises(RunError, match="expected a JSON object"):
        open_run(tmp_path)


def test_every_spec_table_is_a_view_with_its_columns_even_when_empty(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"world_size": 2, "mesh": {"dp": 2}}))
    run = open_run(tmp_path)
    for table, schema in TABLES.items():
        df = run.sql(f"select * from {table}")
        assert list(df.columns) == schema.names and df.empty
    steps = run.sql("select * from steps")
    assert list(steps.columns) == [
        "rank",
        "step",
        "step_ns",
        "compute_ns",
        "comm_ns",
        "exposed_comm_ns",
        "idle_ns",
    ]
    types = dict(run.sql("describe collectives")[["column_name", "column_type"]].values)
    assert types["rank"] == "INTEGER" and types["seq"] == "BIGINT" and types["op"] == "VARCHAR"


def test_views_read_every_rank_with_integer_rank_and_group_membership(world_run):
    run = open_run(world_run)
    assert run.sql("select count(distinct rank) n from spans").n[0] == 8
    assert run.sql("select typeof(rank) t from collectives limit 1").t[0] == "INTEGER"
    members = run.sql(
        """select "group", gid, list(rank order by rank) r from group_members
        group by all order by "group", gid"""
    )
    tp = [list(r) for r in members[members["group"] == "tp"].r]
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # a collective's seq is the same on every member: one instance per (group, gid, seq)
    inst = run.query("findings/collective_instances", lo=0, hi=99)
    tp_inst = inst[inst["group"] == "tp"]
    assert (tp_inst.entered == 2).all() and (tp_inst.transfer_ns > 0).all()


def test_query_binds_parameters_and_steps_view_is_consistent(world_run):
    run = open_run(world_run)
    one = run.query("findings/rank_steps", lo=2, hi=2)
    assert set(one.step) == {2} and len(one) == 8
    steps = run.sql("select * from steps where step = 2 order by rank")
    assert (steps.compute_ns + steps.exposed_comm_ns + steps.idle_ns <= steps.step_ns).all()
    assert (steps.exposed_comm_ns <= steps.comm_ns).all()
    with pytest.raises(KeyError):
        run.query("no_such_query")


def test_corrupt_and_truncated_parts_are_skipped_with_one_warning_each(world_run, tmp_path, caplog):
    import shutil

    run_dir = str(tmp_path / "run")
    shutil.copytree(world_run, run_dir)
    spans3 = os.path.join(run_dir, "spans", "rank=00003")
    part = sorted(os.listdir(spans3))[0]
    with open(os.path.join(spans3, part), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(spans3, part)) // 2)  # truncated
    coll5 = os.path.join(run_dir, "collectives", "rank=00005", "part-000009.parquet")
    with open(coll5, "wb") as f:
        f.write(b"PAR1" + b"\x00" * 100 + b"PAR1")  # garbage between valid magic
    with caplog.at_level(logging.WARNING, logger="analyzer.db"):
        run = open_run(run_dir)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("\n" not in r.getMessage() for r in warnings)
    assert sorted(run.skipped) == sorted([os.path.join(spans3, part), coll5])
    # the rest still reads: rank 3 keeps its second spans part, rank 5 its collectives
    n3 = run.sql("select count(*) n from spans where rank = 3").n[0]
    assert 0 < n3 < run.sql("select count(*) n from spans where rank = 2").n[0]
    assert run.sql("select count(*) n from collectives where rank = 5").n[0] > 0


@pytest.mark.parametrize(
    "meta, fragment",
    [
        ({"world_size": "many"}, "world_size"),
        ({"world_size": 4, "mesh": "dp=2"}, "mesh"),
        ({"world_size": 4, "mesh": {"dp": 0}}, "mesh"),
        ({"world_size": 4, "groups": {"tp": [0, 1]}}, "groups"),
    ],
)
def test_run_json_of_the_wrong_shape_is_one_line(tmp_path, meta, fragment):
    (tmp_path / "run.json").write_text(json.dumps(meta))
    with pytest.raises(RunError, match=fragment) as e:
        open_run(tmp_path)
    assert "\n" not in str(e.value)


def test_duckdb_spills_to_the_temp_folder_not_the_working_directory(world_run, tmp_path):
    import tempfile

    run = open_run(world_run)
    try:
        (spill,) = run.con.execute("select current_setting('temp_directory')").fetchone()
    finally:
        run.close()
    assert os.path.isabs(spill)
    assert os.path.dirname(spill) == tempfile.gettempdir()
    assert not os.path.abspath(spill).startswith(os.getcwd() + os.sep)
