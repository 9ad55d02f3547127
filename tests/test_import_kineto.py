"""`megascope import kineto`: the committed HTA trace, a trace made here, bad files."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import duckdb
import pytest
from helpers.cli import megascope

from analyzer.importers.common import TraceError
from analyzer.importers.kineto import import_kineto
from tracer.rundir import read_run_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECSYS = os.path.join(REPO, "tests", "data", "kineto", "two_rank_recsys")
SQL_DIR = os.path.join(REPO, "analyzer", "sql")

# Holistic Trace Analysis 0.5.0 on the same files (tests/data/README.md), in microseconds.
HTA = {
    0: {"idle": 321378, "compute": 106252, "non_compute": 172428, "pct": (53.56, 17.71, 28.74)},
    1: {"idle": 328671, "compute": 135548, "non_compute": 136455, "pct": (54.72, 22.57, 22.72)},
}


def table(run: str, name: str) -> duckdb.DuckDBPyRelation:
    return duckdb.sql(
        f"select * from read_parquet('{run}/{name}/*/*.parquet', hive_partitioning=false)"
    )


def breakdown(run: str) -> dict[int, tuple]:
    con = duckdb.connect()
    con.execute(
        f"create view spans as select * from read_parquet('{run}/spans/*/*.parquet', "
        "hive_partitioning=false)"
    )
    for view in ("gpu_window", "gpu_breakdown"):  # the SQL files alone, over spans
        with open(os.path.join(SQL_DIR, f"{view}.sql")) as f:
            con.execute(f"create view {view} as {f.read()}")
    rows = con.execute("select * from gpu_breakdown").fetchall()
    return {r[0]: r[1:] for r in rows}


@pytest.fixture(scope="module")
def recsys_run(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("recsys") / "run")
    result = import_kineto(RECSYS, out)
    assert result.ranks == [0, 1] and not result.skipped
    return out


def test_recsys_breakdown_equals_hta(recsys_run):
    got = breakdown(recsys_run)
    assert sorted(got) == [0, 1]
    for rank, want in HTA.items():
        kernel, idle, compute, non_compute = got[rank]
        assert (idle, compute, non_compute) == tuple(
            want[k] * 1000 for k in ("idle", "compute", "non_compute")
        )
        pct = [100 * v / kernel for v in (idle, compute, non_compute)]
        for mine, theirs in zip(pct, want["pct"], strict=True):
            assert abs(mine - theirs) < 1.0


def test_parallel_import_gives_the_same_run(recsys_run, tmp_path):
    out = str(tmp_path / "parallel")
    result = import_kineto(RECSYS, out, workers=2)
    assert result.ranks == [0, 1] and breakdown(out) == breakdown(recsys_run)
    for name in ("spans", "collectives"):
        sql = "select * exclude (rank) from t order by all"
        a = table(out, name).query("t", sql).fetchall()
        b = table(recsys_run, name).query("t", sql).fetchall()
        assert a == b


def test_recsys_breakdown_through_open_run(recsys_run):
    db = pytest.importorskip("analyzer.db")
    df = db.open_run(recsys_run).query("gpu_breakdown")
    idle = dict(zip(df["rank"], df["idle_ns"], strict=True))
    assert idle == {0: 321378000, 1: 328671000}


def test_recsys_collectives_steps_and_kinds(recsys_run):
    rows = table(recsys_run, "collectives").fetchdf()
    assert rows.groupby("rank").size().to_dict() == {0: 10, 1: 10}
    ops = rows[rows["rank"] == 0]["op"].value_counts().to_dict()
    assert ops == {"all_to_all": 4, "all_reduce": 4, "all_gather": 2}
    assert set(rows["step"]) == {551, 552}
    assert (rows["end_ns"] > rows["start_ns"]).all() and (
        rows["issue_ns"] <= rows["start_ns"]
    ).all()
    # per rank, seq numbers the rank's collectives 1..10 in issue order
    assert sorted(rows[rows["rank"] == 1]["seq"]) == list(range(1, 11))
    # a 419430400-element uint8 all-to-all, as its host annotation recorded it
    assert 419430400 in set(rows["nbytes"])
    kinds = table(recsys_run, "spans").fetchdf().groupby(["rank", "kind"]).size().to_dict()
    assert kinds[(0, "comm")] == 10 and kinds[(0, "memory")] == 50 and kinds[(0, "host")] == 2
    meta = read_run_json(recsys_run)
    assert meta["world_size"] == 128 and meta["device"] == "cuda"
    assert meta["import"]["ranks"] == [0, 1] and meta["import"]["profiler_steps"] == [551, 552]


def _modern_trace(rank: int) -> dict:
    """A trace as recent PyTorch writes it with NCCL: collective arguments on the kernels,
    process groups with Megatron descriptions, baseTimeNanoseconds, metadata after events."""
    groups = [
        {"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1, 2, 3], "pg_size": 4},
        {"pg_name": "1", "pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [0, 1], "pg_size": 2},
        {"pg_name": "2", "pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [2, 3], "pg_size": 2},
        {"pg_name": "3", "pg_desc": "DATA_PARALLEL_GROUP", "ranks": [0, 2], "pg_size": 2},
        {"pg_name": "4", "pg_desc": "DATA_PARALLEL_GROUP", "ranks": [1, 3], "pg_size": 2},
    ]
    tp, dp = ("1" if rank < 2 else "2"), ("3" if rank % 2 == 0 else "4")
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 9, "tid": 9,
               "ts": 100.0, "dur": 1000.0}]  # fmt: skip
    kernels = [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "allreduce", tp, 1024, "BFloat16", 5),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "_reduce_scatter_base", dp, 4096, "Float", 11),
    ]  # fmt: skip
    for i, (name, coll, pg, nelems, dtype, seq) in enumerate(kernels):
        corr = 1000 + i
        ranks = next(g["ranks"] for g in groups if g["pg_name"] == pg)
        args = {"stream": 20, "correlation": corr, "Collective name": coll,
                "In msg nelems": nelems, "Out msg nelems": nelems, "dtype": dtype,
                "Group size": 2, "Process Group Name": pg, "Seq": seq,
                "Process Group Description": next(g["pg_desc"] for g in groups if g["pg_name"] == pg),
                "Process Group Ranks": str(ranks)}  # fmt: skip
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 9,
                "tid": 9,
                "ts": 200.0 + i * 100,
                "dur": 5.0,
                "args": {"correlation": corr},
            }
        )
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 20,
                       "ts": 210.5 + i * 100, "dur": 50.25, "args": args})  # fmt: skip
    return {"schemaVersion": 1, "traceEvents": events, "baseTimeNanoseconds": 1_700_000_000_000_000_000,
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 4, "pg_config": groups}}  # fmt: skip


def test_modern_nccl_args_give_groups_mesh_and_seq(tmp_path):
    src = tmp_path / "traces"
    src.mkdir()
    for rank in range(4):
        with gzip.open(src / f"host_{rank}.pt.trace.json.gz", "wt") as f:
            json.dump(_modern_trace(rank), f)  # events come before the metadata here
    out = str(tmp_path / "run")
    import_kineto(str(src), out)
    meta = read_run_json(out)
    assert meta["mesh"] == {"dp": 2, "pp": 1, "tp": 2, "cp": 1}
    assert {
        "name": "tp",
        "ranks": [2, 3],
        "pg_name": "2",
        "desc": "TENSOR_MODEL_PARALLEL_GROUP",
    } in meta["groups"]
    rows = table(out, "collectives").fetchdf().sort_values(["rank", "start_ns"])
    assert list(rows["op"][:2]) == ["all_reduce", "reduce_scatter"]
    assert list(rows["group"][:2]) == ["tp", "dp"] and list(rows["seq"][:2]) == [5, 11]
    assert list(rows["nbytes"][:2]) == [2048, 16384] and list(rows["group_size"][:2]) == [2, 2]
    # sub-microsecond times are rounded as HTA rounds them: start up, end down
    first = rows.iloc[0]
    assert first["start_ns"] == 1_700_000_000_000_000_000 + 211_000
    assert first["end_ns"] - first["start_ns"] == 49_000 and first["step"] == 7
    topo = table(out, "topology").fetchdf().set_index("rank")
    assert (topo.loc[3, "dp"], topo.loc[3, "tp"]) == (1, 1)
    assert meta["import"]["rank_from"]["host_3.pt.trace.json.gz"] == "distributedInfo"
    exact = str(tmp_path / "exact")
    import_kineto(str(src), exact, exact_ns=True)
    rows = table(exact, "collectives").fetchdf().sort_values(["rank", "start_ns"])
    first = rows.iloc[0]
    assert first["start_ns"] == 1_700_000_000_000_000_000 + 210_500
    assert first["end_ns"] - first["start_ns"] == 50_250


def test_truncated_trace_is_skipped_when_others_import(tmp_path):
    src = tmp_path / "traces"
    src.mkdir()
    shutil.copy(os.path.join(RECSYS, "sampled_rank-0.json.gz"), src)
    with gzip.open(os.path.join(RECSYS, "sampled_rank-1.json.gz")) as f:
        data = f.read()
    (src / "sampled_rank-1.json").write_bytes(data[: len(data) // 2])
    out = tmp_path / "run"
    proc = megascope("import", "kineto", str(src), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and "sampled_rank-1.json" in warnings[0] and "warning" in warnings[0]
    meta = read_run_json(str(out))
    assert meta["import"]["ranks"] == [0] and len(meta["import"]["skipped"]) == 1
    proc = megascope("import", "kineto", str(src), "--out", str(tmp_path / "run2"), "--strict")
    assert proc.returncode == 2 and "sampled_rank-1.json" in proc.stderr


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b'{"traceEvents": [{"ph": "X", "ts": 1', "truncated or malformed"),
        (b"[1, 2, 3]", "not a Kineto trace"),
        (b"\x00\x01garbage", "truncated or malformed"),
    ],
)
def test_unusable_trace_alone_exits_2_naming_the_file(tmp_path, content, fragment):
    src = tmp_path / "traces"
    src.mkdir()
    (src / "rank0.json").write_bytes(content)
    proc = megascope("import", "kineto", str(src), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("megascope: error:") and "rank0.json" in lines[-1]
    assert fragment in lines[-1] and "Traceback" not in proc.stderr
    with pytest.raises(TraceError):
        import_kineto(str(src), str(tmp_path / "run3"))


def _profiled_gloo(rank: int, world_size: int, out_dir: str) -> int:
    """A few steps of collectives on gloo under torch.profiler (CPU activities only)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    pair = dist.new_group([0, 1], group_desc="tp")
    x = torch.ones(256)

    def save(prof) -> None:
        prof.export_chrome_trace(os.path.join(out_dir, f"rank{rank}.json"))

    sched = schedule(wait=0, warmup=0, active=3, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=save,
                 record_shapes=True) as prof:  # fmt: skip
        for _ in range(4):
            y = x @ x
            dist.all_reduce(x)
            dist.all_reduce(x, group=pair)
            parts = [torch.zeros(256) for _ in range(world_size)]
            dist.all_gather(parts, x)
            dist.broadcast(x, src=0)
            dist.barrier()
            x = x / float(y)
            prof.step()
    return rank


def test_cpu_gloo_trace_made_here(tmp_path, ranks):

    src = tmp_path / "traces"
    src.mkdir()
    assert ranks(_profiled_gloo, 2, str(src)) == [0, 1]
    out = str(tmp_path / "run")
    result = import_kineto(str(src), out)
    assert result.ranks == [0, 1]
    rows = table(out, "collectives").fetchdf()
    per_rank = rows.groupby("rank")
    assert per_rank.size().to_dict() == {0: 15, 1: 15}  # 3 active steps x 5 collectives
    ops = rows[rows["rank"] == 0]["op"].value_counts().to_dict()
    assert ops == {"all_reduce": 6, "all_gather": 3, "broadcast": 3, "barrier": 3}
    # the same collective has the same seq on both ranks
    a = rows[rows["rank"] == 0].sort_values("seq")[["seq", "op", "nbytes"]].to_numpy().tolist()
    b = rows[rows["rank"] == 1].sort_values("seq")[["seq", "op", "nbytes"]].to_numpy().tolist()
    assert a == b and a[0][2] == 1024
    assert (rows["issue_ns"] <= rows["start_ns"]).all() and (
        rows["end_ns"] >= rows["start_ns"]
    ).all()
    spans = table(out, "spans").fetchdf()
    assert set(spans["source"]) == {"host"} and (spans["name"] == "step").sum() == 6
    assert breakdown(out) == {}  # no device spans: an empty breakdown, not an error
    meta = read_run_json(out)
    assert meta["device"] == "cpu" and meta["world_size"] == 2
