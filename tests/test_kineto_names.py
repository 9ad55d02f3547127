"""Kineto import: ranks and world from the traces, never from numbers that happen to be in a
file name; bad numbers and bad folders are one-line errors (exit 2), fast, never a loop."""

from __future__ import annotations

import gzip
import json
import os

import duckdb
import pytest
from helpers.cli import assert_one_line_error, megascope
from helpers.kineto_corpus import Workload, trace_of

from analyzer.importers.common import TraceError, rank_token
from analyzer.importers.kineto import import_kineto
from tracer.rundir import MAX_WORLD, MeshError, mesh_groups, read_run_json, write_json_atomic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small(seed: int = 1, **kw) -> Workload:
    return Workload(seed=seed, steps=2, launches_per_step=6, **kw)


def write(folder, name: str, doc: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(doc, f)
    return path


def ranks_of(run: str) -> dict[str, int]:
    meta = read_run_json(run)
    return dict(zip(meta["import"]["files"], meta["import"]["ranks"], strict=True))


def test_a_13_digit_timestamp_name_imports(tmp_path):
    """tensorboard_trace_handler's ``{worker}.{ms}.pt.trace.json.gz``: the timestamp is not
    the rank (it overflowed the int32 rank column before)."""
    name = "gpu-host-3_48213.1732291200123.pt.trace.json.gz"
    write(tmp_path / "traces", name, trace_of(small(ns=True)))
    proc = megascope("import", "kineto", str(tmp_path / "traces"), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "1 ranks (0)" in proc.stdout
    meta = read_run_json(str(tmp_path / "run"))
    assert meta["world_size"] == 1 and meta["mesh"]["dp"] == 1
    assert meta["import"]["rank_from"] == {name: "the only file"}


@pytest.mark.parametrize(
    "name",
    [
        "llama3_8b__2876543.json.gz",  # {model}__{job id}: rank ~1,000,000 before
        "mi250_minitoy_train_ROCm6_2_kineto.json.gz",  # read as rank 2 before
        "benchmark_result_2869224_1695835535_trace.json.gz",
        "trace.json",  # refused before ("cannot tell the rank")
    ],
)
def test_a_lone_trace_without_a_rank_is_rank_0_of_1(tmp_path, name):
    write(tmp_path / "traces", name, trace_of(small()))
    result = import_kineto(str(tmp_path / "traces"), str(tmp_path / "run"))
    assert result.ranks == [0] and ranks_of(str(tmp_path / "run")) == {name: 0}
    assert read_run_json(str(tmp_path / "run"))["world_size"] == 1


def test_rank_tokens():
    assert rank_token("rank3.json") == 3
    assert rank_token("trace_rank_3.pt.trace.json") == 3
    assert rank_token("sampled_rank-1.json.gz") == 1
    assert rank_token("RANK.12.json") == 12
    assert rank_token("rank-70.Mar_25_20_48_12.2861.pt.trace.json.gz") == 70
    for name in ("host_1234.1732291200123.pt.trace.json.gz", "model__1000123.json.gz",
                 "mi250_ROCm6_2.json", "prank3.json", "frankly.json", "v2.1_trace.json"):  # fmt: skip
        assert rank_token(name) is None, name


def test_distributed_info_wins_over_the_name_and_the_world_is_stated(tmp_path):
    write(tmp_path / "traces", "rank7.json", trace_of(small(), dist={"rank": 1, "world_size": 4}))
    import_kineto(str(tmp_path / "traces"), str(tmp_path / "run"))
    meta = read_run_json(str(tmp_path / "run"))
    assert ranks_of(str(tmp_path / "run")) == {"rank7.json": 1} and meta["world_size"] == 4
    assert meta["import"]["rank_from"] == {"rank7.json": "distributedInfo"}


def test_without_a_stated_world_the_world_is_the_ranks_present(tmp_path):
    for r in (0, 2):
        write(tmp_path / "traces", f"rank_{r}.json", trace_of(small(seed=r)))
    import_kineto(str(tmp_path / "traces"), str(tmp_path / "run"))
    assert read_run_json(str(tmp_path / "run"))["world_size"] == 3


def test_rankless_traces_beside_ranked_ones_take_the_free_ranks(tmp_path, caplog):
    write(tmp_path / "traces", "rank0.json", trace_of(small(seed=1)))
    write(tmp_path / "traces", "b.json", trace_of(small(seed=2)))
    write(tmp_path / "traces", "a.json", trace_of(small(seed=3)))
    with caplog.at_level("WARNING"):
        import_kineto(str(tmp_path / "traces"), str(tmp_path / "run"))
    assert ranks_of(str(tmp_path / "run")) == {"rank0.json": 0, "a.json": 1, "b.json": 2}
    assert any("a.json=1, b.json=2" in r.getMessage() for r in caplog.records)
    # staged rows end in their rank's folders, with their rank; nothing staged is left
    assert not os.path.exists(tmp_path / "run" / ".unranked")
    got = duckdb.sql(
        f"select distinct rank, filename from read_parquet('{tmp_path}/run/spans/*/*.parquet', "
        "filename=true, hive_partitioning=false)"
    ).fetchall()
    assert sorted(r for r, _ in got) == [0, 1, 2]
    assert all(f"rank={r:05d}" in f for r, f in got)


@pytest.mark.parametrize(
    "name, dist, fragment",
    [
        ("rank_99999999.json", None, "rank 99999999 (from its name) is not a rank"),
        ("worker.json", {"rank": 0, "world_size": 10**12}, f"at most {MAX_WORLD} ranks"),
        ("worker.json", {"rank": 5, "world_size": 4}, "rank 5 is outside the world of 4"),
    ],
)
def test_a_bad_number_is_a_one_line_error(tmp_path, name, dist, fragment):
    write(tmp_path / "traces", name, trace_of(small(), dist=dist))
    proc = megascope("import", "kineto", str(tmp_path / "traces"), "--out", str(tmp_path / "run"))
    assert_one_line_error(proc, "megascope: error:", fragment)
    assert not os.path.exists(tmp_path / "run")


def test_two_jobs_in_one_folder_are_refused(tmp_path):
    write(tmp_path / "dup", "jobA_rank0.json", trace_of(small(seed=1)))
    write(tmp_path / "dup", "jobB_rank0.json", trace_of(small(seed=2)))
    proc = megascope("import", "kineto", str(tmp_path / "dup"), "--out", str(tmp_path / "run"))
    assert_one_line_error(proc, "megascope: error:", "both rank 0", "two jobs")
    assert not os.path.exists(tmp_path / "run")
    write(tmp_path / "worlds", "a.json", trace_of(small(seed=1), dist={"rank": 0, "world_size": 2}))
    write(tmp_path / "worlds", "b.json", trace_of(small(seed=2), dist={"rank": 1, "world_size": 4}))
    proc = megascope("import", "kineto", str(tmp_path / "worlds"), "--out", str(tmp_path / "run"))
    assert_one_line_error(proc, "megascope: error:", "world size 2", "two jobs")


def test_a_kineto_file_that_is_not_json_is_a_one_line_error(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    with gzip.open(folder / "host_1.1732291200123.pt.trace.json.gz", "wb") as f:
        f.write(b"<html>not a trace</html>")
    proc = megascope("import", "kineto", str(folder), "--out", str(tmp_path / "run"))
    assert_one_line_error(
        proc, "megascope: error:", "host_1.1732291200123.pt.trace.json.gz", "malformed"
    )
    with pytest.raises(TraceError):
        import_kineto(str(folder), str(tmp_path / "run2"))


def test_mesh_groups_cost_the_ranks_not_their_square():
    groups = mesh_groups({"dp": 1_000_000})  # the mesh an old import derived from a job id
    assert len(groups) == 1 and len(groups[0]["ranks"]) == 1_000_000
    assert mesh_groups({"dp": 2, "pp": 2, "tp": 2}) == [
        {"name": "tp", "ranks": [0, 1]}, {"name": "tp", "ranks": [2, 3]},
        {"name": "tp", "ranks": [4, 5]}, {"name": "tp", "ranks": [6, 7]},
        {"name": "dp", "ranks": [0, 2]}, {"name": "dp", "ranks": [1, 3]},
        {"name": "dp", "ranks": [4, 6]}, {"name": "dp", "ranks": [5, 7]},
        {"name": "pp", "ranks": [0, 4]}, {"name": "pp", "ranks": [1, 5]},
        {"name": "pp", "ranks": [2, 6]}, {"name": "pp", "ranks": [3, 7]},
    ]  # fmt: skip
    with pytest.raises(MeshError, match="more than"):
        mesh_groups({"dp": 1 << 30, "tp": 8})
    with pytest.raises(MeshError, match="not a positive integer"):
        mesh_groups({"dp": 0})


def test_a_run_claiming_a_huge_world_is_refused_in_one_line(tmp_path):
    write(tmp_path / "traces", "rank0.json", trace_of(small()))
    run = str(tmp_path / "run")
    import_kineto(str(tmp_path / "traces"), run)
    meta = read_run_json(run)
    meta["world_size"], meta["mesh"] = 10**9, {"dp": 10**9, "pp": 1, "tp": 1, "cp": 1}
    write_json_atomic(os.path.join(run, "run.json"), meta)
    proc = megascope("sql", run, "select count(*) from gpu_breakdown")
    assert_one_line_error(proc, "megascope: error:", "world_size 1000000000")
