"""`megascope import flight-recorder`: the Megatron set (ranks 9 and 14), a gloo dump made
here with a rank held back, hostile and truncated pickles."""

from __future__ import annotations

import os
import pickle
import shutil

import duckdb
import pytest
from helpers.cli import megascope

from analyzer.importers.common import RefusedTrace, TraceError
from analyzer.importers.flight_recorder import import_flight_recorder, load_dump
from tracer.rundir import read_run_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON = os.path.join(REPO, "tests", "data", "flight_recorder", "gpu_error_2nd")


def behind(run: str) -> dict[str, set[int]]:
    """Per group instance, the members whose last seq is lower than a peer's: computed from
    the imported rows and run.json's groups alone (what any hang detector has to work with)."""
    meta = read_run_json(run)
    rows = duckdb.sql(
        f"""select rank, "group", max(seq) as last from read_parquet(
        '{run}/collectives/*/*.parquet', hive_partitioning=false) where peer = -1 group by all"""
    ).fetchall()
    last = {(r, g): s for r, g, s in rows}
    out: dict[str, set[int]] = {}
    for g in meta["groups"]:
        members = [r for r in g["ranks"] if (r, g["name"]) in last]
        if len(members) < 2:
            continue
        top = max(last[(r, g["name"])] for r in members)
        late = {r for r in g["ranks"] if last.get((r, g["name"]), -1) < top}
        if late:
            out[f"{g['name']}{g['ranks']}"] = late
    return out


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("fr") / "run")
    result = import_flight_recorder(MEGATRON, out)
    assert result.ranks == list(range(16)) and result.status == "hung"
    return out


def test_megatron_mesh_groups_and_rows(megatron_run):
    meta = read_run_json(megatron_run)
    assert meta["status"] == "hung" and meta["world_size"] == 16 and meta["device"] == "cuda"
    assert meta["mesh"] == {"dp": 2, "pp": 2, "tp": 4, "cp": 1}
    groups = {(g["name"], tuple(g["ranks"])) for g in meta["groups"]}
    assert ("tp", (8, 9, 10, 11)) in groups and ("pp", (1, 9)) in groups
    assert ("dp", (9, 13)) in groups and (
        "EXPERT_MODEL_PARALLEL_GROUP",
        tuple(range(8, 16)),
    ) in groups
    topo = duckdb.sql(
        f"select rank, dp, pp, tp from read_parquet('{megatron_run}/topology/*/*.parquet', "
        "hive_partitioning=false) where rank in (9, 14) order by rank"
    ).fetchall()
    assert topo == [(9, 0, 1, 1), (14, 1, 1, 2)]
    rows = duckdb.sql(
        f"select * from read_parquet('{megatron_run}/collectives/*/*.parquet', hive_partitioning=false)"
    ).fetchdf()
    assert len(rows) == 278 and rows["end_ns"].isna().all()  # every entry was still pending
    r9 = rows[(rows["rank"] == 9) & (rows["group"] == "tp")].sort_values("seq")
    assert list(r9["seq"]) == list(range(87749, 87761))
    first = r9.iloc[0]
    assert (first["op"], first["nbytes"], first["dtype"]) == (
        "all_gather",
        2048 * 5120 * 2,
        "bfloat16",
    )
    p2p = rows[(rows["rank"] == 9) & (rows["peer"] >= 0)].set_index("op")
    assert p2p.loc["recv", "peer"] == 1 and p2p.loc["send", "peer"] == 1  # local 0 of [1, 9]
    beats = duckdb.sql(
        f"select count(*), min(state), max(state) from read_parquet('{megatron_run}/heartbeats/*/*.parquet', hive_partitioning=false)"
    ).fetchall()
    assert beats == [(16, "scheduled", "scheduled")]


def test_megatron_laggards_are_9_and_14_in_every_group_that_disagrees(megatron_run):
    late = behind(megatron_run)
    assert late, "some group must disagree"
    assert set().union(*late.values()) == {9, 14}
    assert late["tp[8, 9, 10, 11]"] == {9} and late["tp[12, 13, 14, 15]"] == {14}


def test_analyze_names_exactly_ranks_9_and_14(megatron_run):
    findings = pytest.importorskip("analyzer.findings")
    db = pytest.importorskip("analyzer.db")
    report = findings.analyze(db.open_run(megatron_run))
    hangs = [f for f in report["findings"] if f["kind"] == "hang"]
    assert hangs, report
    assert set().union(*(set(f["ranks"]) for f in hangs)) == {9, 14}


def test_json_and_pickle_load_to_the_same_entries(tmp_path):
    dump = load_dump(os.path.join(MEGATRON, "_dump_3"))
    assert dump["version"] == "2.9" and len(dump["entries"]) == 11
    import json

    path = tmp_path / "rank_3.json"
    path.write_text(json.dumps(dump))
    again = load_dump(str(path))
    assert [e["collective_seq_id"] for e in again["entries"]] == [
        e["collective_seq_id"] for e in dump["entries"]
    ]


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_refused_and_never_runs(tmp_path):
    src = tmp_path / "dumps"
    shutil.copytree(MEGATRON, src)
    marker = tmp_path / "pwned"
    payload = {"version": "2.9", "pg_config": {}, "entries": [{"x": _Evil(str(marker))}]}
    (src / "_dump_16").write_bytes(pickle.dumps(payload))
    with pytest.raises(RefusedTrace, match="refusing global"):
        load_dump(str(src / "_dump_16"))
    proc = megascope("import", "flight-recorder", str(src), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("megascope: error:") and "_dump_16" in line and "refusing" in line
    assert not marker.exists() and not (tmp_path / "run" / "run.json").exists()


def test_truncated_dump_skipped_or_fatal(tmp_path):
    src = tmp_path / "dumps"
    shutil.copytree(MEGATRON, src)
    data = (src / "_dump_5").read_bytes()
    (src / "_dump_5").write_bytes(data[: len(data) // 3])
    proc = megascope("import", "flight-recorder", str(src), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and "_dump_5" in warnings[0] and "truncated" in warnings[0]
    meta = read_run_json(str(tmp_path / "run"))
    assert meta["import"]["missing_ranks"] == [5] and meta["world_size"] == 16
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(src / "_dump_5", alone)
    proc = megascope("import", "flight-recorder", str(alone), "--out", str(tmp_path / "run2"))
    assert proc.returncode == 2 and "_dump_5" in proc.stderr.strip().splitlines()[-1]
    with pytest.raises(TraceError, match="truncated"):
        import_flight_recorder(str(alone), str(tmp_path / "run3"))


def _gloo_hold_back(rank: int, world_size: int, out_dir: str, held: int) -> int:
    """All ranks run a few collectives on the world and on pairs ("tp"); then every rank but
    ``held`` enters one more world all_reduce. Each rank dumps its Flight Recorder while the
    held rank is still out; only then does the held rank join, so the run ends cleanly."""
    import time

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace_json

    store = dist.distributed_c10d._get_default_store()
    pairs = [dist.new_group([r, r + 1], group_desc="tp") for r in range(0, world_size, 2)]
    mine = pairs[rank // 2]
    x = torch.ones(64)
    for _ in range(3):
        dist.all_reduce(x)
        dist.all_reduce(x, group=mine)
    if rank != held:
        work = dist.all_reduce(x, async_op=True)
        time.sleep(0.5)  # let Flight Recorder retire the entries that did complete
        with open(os.path.join(out_dir, f"fr_rank_{rank}.json"), "wb") as f:
            f.write(_dump_fr_trace_json(True, True))
        store.set(f"dumped{rank}", "1")
    else:
        store.wait([f"dumped{r}" for r in range(world_size) if r != held])
        with open(os.path.join(out_dir, f"fr_rank_{rank}.json"), "wb") as f:
            f.write(_dump_fr_trace_json(True, True))
        work = dist.all_reduce(x, async_op=True)
    work.wait()
    return rank


def test_gloo_dump_with_a_rank_held_back(tmp_path, monkeypatch, ranks):

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    src = tmp_path / "dumps"
    src.mkdir()
    assert ranks(_gloo_hold_back, 4, str(src), 3) == [0, 1, 2, 3]
    out = str(tmp_path / "run")
    result = import_flight_recorder(str(src), out)
    assert result.status == "hung"
    meta = read_run_json(out)
    assert meta["mesh"] == {"dp": 2, "pp": 1, "tp": 2, "cp": 1} and meta["device"] == "cpu"
    late = behind(out)
    assert late == {f"default_pg{list(range(4))}": {3}}
    stuck = duckdb.sql(
        f"""select rank, op, "group", seq from read_parquet('{out}/collectives/*/*.parquet',
        hive_partitioning=false) where end_ns is null order by rank"""
    ).fetchall()
    # Ranks 0-2 wait in the fourth world all_reduce; rank 3 never entered it. (An entry of
    # a collective that did complete may still be unretired when the dump is taken.)
    assert [row for row in stuck if row[2] == "default_pg"] == [
        (r, "all_reduce", "default_pg", 4) for r in range(3)
    ]
    assert not [row for row in stuck if row[0] == 3]
    findings = pytest.importorskip("analyzer.findings")
    db = pytest.importorskip("analyzer.db")
    hangs = [f for f in findings.analyze(db.open_run(out))["findings"] if f["kind"] == "hang"]
    assert [f["ranks"] for f in hangs] == [[3]]


def _copy_megatron(tmp_path, ranks=range(16)) -> str:
    src = tmp_path / "dumps"
    src.mkdir()
    for r in ranks:
        shutil.copy(os.path.join(MEGATRON, f"_dump_{r}"), src)
    return str(src)


def _one_line_exit_2(src: str, out: str) -> str:
    proc = megascope("import", "flight-recorder", src, "--out", out)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("megascope: error:")
    assert not os.path.exists(os.path.join(out, "run.json"))
    return lines[-1]


def test_a_dump_of_an_unknown_version_is_refused(tmp_path):
    src = _copy_megatron(tmp_path)
    dump = load_dump(os.path.join(src, "_dump_4"))
    for version in ("3.0", "x", None):
        dump["version"] = version
        with open(os.path.join(src, "_dump_4"), "wb") as f:
            f.write(pickle.dumps(dump))
        line = _one_line_exit_2(src, str(tmp_path / f"run-{version}"))
        assert "_dump_4" in line and "unknown Flight Recorder format version" in line


def test_a_mix_of_two_jobs_is_refused_and_said_so(tmp_path):
    # two dumps of one rank (the second job's rank 3 under another name)
    src = _copy_megatron(tmp_path)
    shutil.copy(os.path.join(MEGATRON, "_dump_3"), os.path.join(src, "other_job_rank_3"))
    line = _one_line_exit_2(src, str(tmp_path / "run1"))
    assert "second dump for rank 3" in line and "two jobs" in line
    # a job of another shape: the same group name with other members
    shutil.rmtree(src)
    src = _copy_megatron(tmp_path)
    dump = load_dump(os.path.join(src, "_dump_10"))
    dump["pg_config"]["37"]["ranks"] = "[0, 1, 2, 3, 4, 5, 6, 7]"
    with open(os.path.join(src, "_dump_10"), "wb") as f:
        f.write(pickle.dumps(dump))
    line = _one_line_exit_2(src, str(tmp_path / "run2"))
    assert "process group 37" in line and "two jobs" in line
    # another PyTorch: another format version
    shutil.rmtree(src)
    src = _copy_megatron(tmp_path)
    dump = load_dump(os.path.join(src, "_dump_7"))
    dump["version"] = "2.10"
    with open(os.path.join(src, "_dump_7"), "wb") as f:
        f.write(pickle.dumps(dump))
    line = _one_line_exit_2(src, str(tmp_path / "run3"))
    assert "two jobs" in line and "version" in line


def test_gzip_dumps_and_a_truncated_one(tmp_path):
    import gzip

    src = tmp_path / "dumps"
    src.mkdir()
    for r in range(16):
        with open(os.path.join(MEGATRON, f"_dump_{r}"), "rb") as f:
            data = f.read()
        (src / f"_dump_{r}.gz").write_bytes(gzip.compress(data))
    out = str(tmp_path / "run")
    assert import_flight_recorder(str(src), out).ranks == list(range(16))
    data = (src / "_dump_6.gz").read_bytes()
    (src / "_dump_6.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="_dump_6.gz: truncated"):
        load_dump(str(src / "_dump_6.gz"))
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(src / "_dump_6.gz", alone)
    line = _one_line_exit_2(str(alone), str(tmp_path / "run2"))
    assert "_dump_6.gz" in line and "truncated" in line


def test_p2p_peers_are_group_local_numbers(megatron_run):
    rows = duckdb.sql(
        f"""select rank, "group", op, peer from read_parquet('{megatron_run}/collectives/*/*.parquet',
        hive_partitioning=false) where peer >= 0 and rank = 0"""
    ).fetchall()
    # rank 0 is place 0 of the pipeline group [0, 8]: "send 0->1" goes to rank 8
    assert ("pp", "send", 8) in {(g, o, p) for _, g, o, p in rows}


NCCL_WORLD1 = os.path.join(REPO, "tests", "data", "flight_recorder", "nccl_world1")


def test_real_nccl_dumps_become_rows_with_device_durations(tmp_path):
    """A real ProcessGroupNCCL buffer (one H200, NCCL's timing on): every collective a row whose
    start is its end less the device's own duration; without timing, the issue time."""
    for name, timed in (("nccl_timing_done", True), ("nccl_notiming_done", False)):
        src = tmp_path / name
        src.mkdir()
        shutil.copy(os.path.join(NCCL_WORLD1, f"{name}.pkl"), src / "_dump_0")
        out = str(tmp_path / f"{name}-run")
        assert import_flight_recorder(str(src), out).ranks == [0]
        entries = {e["collective_seq_id"]: e for e in load_dump(str(src / "_dump_0"))["entries"]}
        rows = duckdb.sql(
            f"select seq, issue_ns, start_ns, end_ns, source from read_parquet('{out}/collectives/*/*.parquet', "
            "hive_partitioning=false) order by seq"
        ).fetchall()
        assert [r[0] for r in rows] == sorted(entries)
        for seq, issue, start, end, source in rows:
            e = entries[seq]
            assert source == "flight_recorder" and end == e["time_discovered_completed_ns"]
            if timed:
                assert abs((end - start) - e["duration_ms"] * 1e6) < 2
            else:
                assert start == issue == e["time_created_ns"]
