"""The torch-free contract modules: schema, run-directory writer, fault language."""

import json
import os

import duckdb
import pytest

from tracer.faults import FaultSpecError, parse_fault
from tracer.rundir import base_run_json, coords_of, mesh_groups, rank_of, read_run_json, write_part
from tracer.schema import TABLES


def test_rank_order_pipeline_outermost_tensor_innermost():
    mesh = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}
    assert coords_of(5, mesh) == {"dp": 0, "pp": 1, "tp": 1, "cp": 0}
    assert coords_of(3, mesh) == {"dp": 1, "pp": 0, "tp": 1, "cp": 0}
    assert [rank_of(coords_of(r, mesh), mesh) for r in range(8)] == list(range(8))
    groups = mesh_groups(mesh)
    assert {"name": "tp", "ranks": [0, 1]} in groups
    assert {"name": "dp", "ranks": [0, 2]} in groups
    assert {"name": "pp", "ranks": [1, 5]} in groups
    assert len(groups) == 12


def test_write_part_is_readable_by_duckdb_with_int_rank(tmp_path):
    run = str(tmp_path)
    cols = {f.name: [] for f in TABLES["heartbeats"]}
    cols.update(rank=[3, 3], ts_ns=[1, 2], step=[0, 1], state=["step", "step"])
    p1 = write_part(run, "heartbeats", 3, cols)
    p2 = write_part(run, "heartbeats", 3, cols)
    assert p1.endswith("rank=00003/part-000000.parquet") and p2.endswith("part-000001.parquet")
    assert not [n for n in os.listdir(os.path.dirname(p1)) if n.endswith(".tmp")]
    rows = duckdb.sql(
        f"select rank, typeof(rank), count(*) from read_parquet('{run}/heartbeats/*/*.parquet', hive_partitioning=false) group by all"
    ).fetchall()
    assert rows == [(3, "INTEGER", 4)]


def test_run_json_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="no run.json"):
        read_run_json(str(tmp_path))
    (tmp_path / "run.json").write_text("{garbage")
    with pytest.raises(ValueError) as e:
        read_run_json(str(tmp_path))
    assert "\n" not in str(e.value)
    (tmp_path / "run.json").write_text(json.dumps(base_run_json(world_size=2, mesh={"dp": 2})))
    assert read_run_json(str(tmp_path))["mesh"] == {"dp": 2, "pp": 1, "tp": 1, "cp": 1}


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("slow:rank=1", "unknown fault kind"),
        ("slow_rank:rank=9,factor=2", "outside the world of 8"),
        ("slow_rank:rank=1,factor=abc", "not a number"),
        ("slow_rank:rank=1,factor=0.5", "factor must be"),
        ("slow_rank:rank=1", "missing factor"),
        ("hang:rank=1,step=-2", "step must be >= 0"),
        ("slow_link:ranks=3,factor=2", "must be A-B"),
        ("slow_link:ranks=3-3,factor=2", "two different ranks"),
        ("pause:rank=1,every=0,ms=5", "every must be >= 1"),
        ("crash:rank=1,step=2,color=red", "unknown key 'color'"),
        ("crash", "expected crash:"),
    ],
)
def test_bad_fault_specs_name_the_problem(spec, fragment):
    with pytest.raises(FaultSpecError) as e:
        parse_fault(spec, world_size=8)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_good_fault_specs():
    f = parse_fault("slow_link:ranks=2-6,factor=4", 8)
    assert f.kind == "slow_link" and f.ranks == (2, 6) and f.factor == 4.0 and f.touches(6)
    f = parse_fault(" pause:rank=1,every=5,ms=200 ")
    assert (f.rank, f.every, f.ms, f.spec) == (1, 5, 200.0, "pause:rank=1,every=5,ms=200")
