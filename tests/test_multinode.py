"""A run over two nodes: two ``megascope train`` launches on this machine, ``--nnodes 2`` and
``--node-rank 0|1``, one run directory. It must be one run: one run.json whose status and
summary cover every rank, every file owned by one node, and a launch pointed at the same run
by mistake refused in one line. Then the same run split per node, as local disks would leave
it, gathered back into one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers.cli import run_main

from analyzer.commands.gather import gather
from analyzer.db import open_run
from analyzer.findings import analyze
from tracer.cliutil import UsageError
from trainer.cliconfig import resolve
from trainer.launch import free_port, prepare_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, LOCAL = 4, 2  # two "nodes" of two ranks: dp 4


def _launch(launch, run: str, node: int, port: int, *extra: str) -> subprocess.Popen:
    return launch(
        [sys.executable, "-m", "analyzer", "train", "--dp", "4", "--steps", "8",
         "--device", "cpu",
         "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--out", run, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _owner(rel: str) -> int | None:
    """The node that may write a file of the run directory, by its path (None: unknown)."""
    parts = rel.split("/")
    rank_of = lambda r: int(r) // LOCAL  # noqa: E731
    if rel in ("run.json", ".progress/launch.json", ".progress/steps.jsonl",
               ".progress/model.json", ".run.json.lock", ".storage.json"):  # fmt: skip
        # node 0's launcher, rank 0 (and run.json's lock and the status record reserved for a
        # disk that fills, docs/spec.md §1)
        return 0
    if parts[0] == ".progress" and parts[1].startswith(("node-", "launch-node-")):
        return int(parts[1].split("-")[-1].split(".")[0])
    if parts[0] in (".progress", ".ranks") and parts[1].startswith(("rank-", "memory-")):
        return rank_of(parts[1].split("-")[1].removesuffix(".json"))  # written by that rank
    if len(parts) == 3 and parts[1].startswith("rank="):
        return rank_of(parts[1][5:])
    return None


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, launch, train) -> tuple[str, list[str]]:
    run = str(tmp_path_factory.mktemp("multinode") / "run")
    port = free_port()
    nodes = [
        _launch(launch, run, 1, port)
    ]  # node 1 first: it must not need node 0's files to start
    time.sleep(0.5)
    nodes.append(_launch(launch, run, 0, port))
    claim = os.path.join(run, ".progress", "node-00001.json")
    deadline = time.monotonic() + 30
    while not os.path.exists(claim) and time.monotonic() < deadline:
        time.sleep(0.1)
    # a second launch of node 1 by mistake, while the run is under way
    dup = train("--dp", "4", "--steps", "8", "--device", "cpu", "--nnodes", "2",
                "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--out", run,
                timeout=120)  # fmt: skip
    logs = []
    for p in nodes:
        out, _ = p.communicate(timeout=300)
        logs.append(out)
        assert p.returncode == 0, out[-3000:]
    return run, [dup.returncode, dup.stderr, *logs]


def test_two_nodes_make_one_run(two_node_run):
    run, (dup_code, dup_err, *_logs) = two_node_run
    assert dup_code == 2 and dup_err.count("\n") == 1
    assert "node 1 of this run is already launched" in dup_err
    with open(os.path.join(run, "run.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["status"] == "finished" and meta["world_size"] == WORLD
    assert meta["summary"]["steps"] == 8 and meta["summary"]["ranks_reporting"] == WORLD
    assert [(n["node"], n["ranks"], n["status"]) for n in meta["nodes"]] == [
        (0, [0, 1], "finished"),
        (1, [2, 3], "finished"),
    ]
    # every file belongs to one node by its path, and each rank's rows are its own
    for d, _, files in os.walk(run):
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), run).replace(os.sep, "/")
            assert _owner(rel) is not None, rel
    r = open_run(run)
    try:
        ranks = r.sql("select distinct rank from spans order by rank")["rank"].tolist()
        assert ranks == list(range(WORLD))
        per_step = r.sql("select step, count(distinct rank) as n from rank_step_sums group by step")
        report = analyze(r)
    finally:
        r.close()
    assert sorted(per_step["step"]) == list(range(8)) and (per_step["n"] == WORLD).all()
    assert report["run"]["world_size"] == WORLD  # one run, read as one
    assert not [f for f in report["findings"] if f["kind"] in ("hang", "crash")]


def test_a_run_split_per_node_is_gathered_into_one(two_node_run, tmp_path):
    run, _ = two_node_run
    # what per-node local disks leave: node 0's folder saw node 1's nothing
    homes = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    for d, _, files in os.walk(run):
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), run).replace(os.sep, "/")
            dest = homes[_owner(rel)] / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(d, name), dest)
    meta_path = homes[0] / "run.json"
    meta = json.loads(meta_path.read_text())
    meta["nodes"][1] = {"node": 1}  # node 0 never saw node 1's outcome
    meta["status"] = "failed"  # e.g. node 0 took node 1's silence badly: gather recomputes
    meta["summary"]["ranks_reporting"] = LOCAL
    # node 1's ranks found no run.json on their disk: their own entries went to .ranks/
    for rank in range(LOCAL, WORLD):
        (homes[1] / ".ranks").mkdir(exist_ok=True)
        mine = {"tracer_cpu": meta["tracer_cpu"].pop(str(rank))}
        (homes[1] / ".ranks" / f"rank-{rank:05d}.json").write_text(json.dumps(mine))
    meta_path.write_text(json.dumps(meta))
    with open(homes[1] / ".progress" / "node-00001.json", encoding="utf-8") as f:
        claim = json.load(f)
    claim["status"] = "hung"  # node 1 saw a hang: the run is hung
    (homes[1] / ".progress" / "node-00001.json").write_text(json.dumps(claim))
    out = str(tmp_path / "gathered")
    res = gather([str(h) for h in homes], out)
    assert res["status"] == "hung"
    with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
        merged = json.load(f)
    assert merged["summary"]["ranks_reporting"] == WORLD
    assert sorted(merged["tracer_cpu"], key=int) == [str(r) for r in range(WORLD)]
    assert [n["status"] for n in merged["nodes"]] == ["finished", "hung"]
    a, b = open_run(run), open_run(out)
    try:
        for view in ("spans", "collectives", "steps"):
            q = f"select * from {view} order by all"
            assert a.sql(q).equals(b.sql(q)), view
    finally:
        a.close()
        b.close()
    # the same file, different in two sources: written by two nodes, refused
    other = homes[1] / ".progress" / "model.json"
    other.write_text("{}")
    with pytest.raises(UsageError, match="two sources"):
        gather([str(h) for h in homes], str(tmp_path / "again"))
    with pytest.raises(UsageError, match="already exists"):
        gather([str(homes[0])], out)


def test_launches_pointed_at_one_run_by_mistake_are_refused(tmp_path):
    run = str(tmp_path / "run")
    common = ["--dp", "4", "--device", "cpu", "--out", run, "--no-trace"]
    two = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"]
    prepare_run(resolve([*common, *two, "--node-rank", "0"]))  # node 0 of a 2-node run
    with pytest.raises(UsageError, match="node 0 of this run is already launched"):
        prepare_run(resolve([*common, *two, "--node-rank", "0"]))
    with pytest.raises(UsageError, match="already launched|already holds a run"):
        prepare_run(resolve(common))  # a one-node launch onto it
    with pytest.raises(UsageError, match="another launch's run"):
        prepare_run(resolve(["--dp", "2", "--pp", "2", *common[2:], *two, "--node-rank", "1"]))
    prepare_run(resolve([*common, *two, "--node-rank", "1"]))  # the right node 1 joins
    with pytest.raises(UsageError, match="node 1 of this run is already launched"):
        prepare_run(resolve([*common, *two, "--node-rank", "1"]))
    res = run_main("train", *common, *two, "--node-rank", "1")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
