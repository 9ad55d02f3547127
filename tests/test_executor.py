"""analyze on Dask distributed (a real LocalCluster on 127.0.0.1) and analyze in windows.

The Dask engine must give the embedded engine's report on every sample and on a small synth
run of every fault kind; its scheduler, workers and nannies listen on loopback only; windows
date a straggler that starts mid-run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import cli
from helpers.report import diagnose

psutil = pytest.importorskip("psutil")

from analyzer.db import open_run  # noqa: E402
from analyzer.executor import LocalEngine, partitions  # noqa: E402
from analyzer.windows import analyze_windows, cut, timeline  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = [
    os.path.join(ROOT, "samples", d)
    for d in sorted(os.listdir(os.path.join(ROOT, "samples")))
    if os.path.isfile(os.path.join(ROOT, "samples", d, "run.json"))
]
MESH = "dp=2,pp=2,tp=2"
FAULTS = {  # one small synth run per fault kind of docs/spec.md §5 that synth simulates
    "slow_rank": ["--inject", "slow_rank:rank=3,factor=1.5"],
    "slow_link": ["--inject", "slow_link:ranks=0-4,factor=4"],
    "hang": ["--inject", "hang:rank=5,step=7"],
    "crash": ["--inject", "crash:rank=2,step=7"],
    "pause": ["--inject", "pause:rank=6,every=3,ms=80"],
    "slow_data": ["--inject", "slow_data:rank=1,ms=60"],
    "seq_skew": ["--inject", "seq_skew:rank=0,factor=2"],
    "hot_expert": ["--experts", "4", "--ep", "2", "--inject", "hot_expert:expert=1,share=0.5"],
}
# Dask runs in child processes: this session's sys.path starts with tests/, whose
# distributed.py (the gloo helper) hides Dask's distributed package.
SERVE = (
    "import sys; from analyzer.executor import DaskEngine; e = DaskEngine(workers=2); "
    "print(e.info['scheduler'], flush=True); sys.stdin.read(); e.close()"
)
REPORTS = """
import json, sys
from analyzer.db import open_run
from analyzer.executor import DaskEngine, digests_hook
from analyzer.findings import analyze
with DaskEngine(sys.argv[1]) as engine:
    for path in sys.argv[2:]:
        engine.tasks.clear()
        run = open_run(path, digests=digests_hook(engine))
        report = analyze(run)
        run.close()
        report["engine"] = engine.report()
        print(json.dumps(report), flush=True)
"""
RAW = dict(os.environ, MEGASCOPE_DIGESTS="raw")  # digest the raw rows, write no cache


def megascope(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The command line on raw rows (helpers/cli.py), checked unless ``check`` is False."""
    return cli.megascope(*args, env={"MEGASCOPE_DIGESTS": "raw"}, check=check)


@pytest.fixture(scope="module")
def cluster():
    """A LocalCluster of 2 workers in a child process: (that process, its scheduler)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, cwd=ROOT, env=RAW,
    )  # fmt: skip
    address = proc.stdout.readline().strip()
    assert address.startswith("tcp://"), address
    yield proc, address
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    runs = {}
    for kind, extra in FAULTS.items():
        out = str(root / kind)
        megascope("synth", "--mesh", MESH, "--steps", "10", "--out", out, "--quiet", *extra)
        runs[kind] = out
    return runs


def test_the_cluster_listens_on_loopback_only(cluster):
    proc, address = cluster
    server = psutil.Process(proc.pid)
    listening = []
    for p in [server] + server.children(recursive=True):
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        listening += [c.laddr for c in conns if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 5  # the scheduler, and each worker's and nanny's listener
    assert all(a.ip in ("127.0.0.1", "::1") for a in listening), listening
    assert address.startswith("tcp://127.0.0.1:")


def test_dask_findings_equal_local_on_every_sample_and_fault(cluster, fault_runs, monkeypatch):
    monkeypatch.setenv("MEGASCOPE_DIGESTS", "raw")
    paths = SAMPLES + list(fault_runs.values())
    out = subprocess.run(
        [sys.executable, "-c", REPORTS, cluster[1], *paths], capture_output=True, text=True,
        env=RAW, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    reports = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(reports) == len(paths)
    local = {path: diagnose(path) for path in paths}
    for path, dask in zip(paths, reports, strict=True):
        tasks = dask["engine"]["tasks"]
        assert tasks and {t["pid"] for t in tasks}.isdisjoint({os.getpid()}), path
        for key in ("findings", "dismissed", "notes", "run"):
            assert dask[key] == local[path][key], (path, key)
    kinds = {k: {f["kind"] for f in local[p]["findings"]} for k, p in fault_runs.items()}
    assert "straggler" in kinds["slow_rank"] and "hang" in kinds["hang"]


def test_partitions_hold_every_folder_once(fault_runs):
    run = open_run(fault_runs["slow_rank"])
    try:
        parts = partitions(run, 16)
        files = [f for p in parts for fs in p.files.values() for f in fs]
        assert len(files) == len(set(files)) == run.parts["collectives"] + run.parts["spans"]
        assert [p.ranks for p in parts] == sorted(p.ranks for p in parts)
    finally:
        run.close()


def test_cli_on_a_running_scheduler_records_each_task(cluster, fault_runs):
    out = megascope(
        "analyze", fault_runs["slow_rank"], "--json", "--engine", "dask", "--scheduler", cluster[1]
    ).stdout
    report = json.loads(out)
    tasks = report["engine"]["tasks"]
    assert report["engine"]["name"] == "dask" and report["engine"]["digests"] == "tasks"
    assert sum(t["rows_in"]["collectives"] for t in tasks) > 0
    assert all(t["seconds"] >= 0 and t["rows_out"]["spans"] > 0 for t in tasks)
    bad = megascope("analyze", fault_runs["slow_rank"], "--scheduler", "x", check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_windows_date_a_straggler_that_starts_mid_run(tmp_path, cluster):
    run_dir = str(tmp_path / "late")
    megascope("synth", "--mesh", "dp=4,pp=2,tp=2", "--steps", "40", "--out", run_dir, "--quiet",
              "--inject", "slow_rank:rank=5,factor=1.5,step=20")  # fmt: skip
    report = json.loads(megascope("analyze", run_dir, "--windows", "10", "--json").stdout)
    assert [w["steps"] for w in report["windows"]] == [[2, 11], [12, 21], [22, 31], [32, 39]]
    stragglers = [e for e in report["timeline"] if e["kind"] == "straggler"]
    assert len(stragglers) == 1 and stragglers[0]["ranks"] == [5]
    assert 18 <= stragglers[0]["first_step"] <= 22 and stragglers[0]["last_step"] == 39
    assert not any(f["kind"] == "straggler" for f in report["windows"][0]["findings"])
    on_dask = json.loads(
        megascope("analyze", run_dir, "--windows", "10", "--json", "--engine", "dask",
                  "--scheduler", cluster[1]).stdout
    )  # fmt: skip
    assert on_dask["windows"] == report["windows"]
    assert on_dask["timeline"] == report["timeline"]
    run = open_run(run_dir)
    try:
        quick = analyze_windows(run, 10, LocalEngine(), whatif=False)
        assert [e["kind"] for e in quick["timeline"]] == ["straggler"]
    finally:
        run.close()
    last = json.loads(megascope("analyze", run_dir, "--last", "10", "--json").stdout)
    assert last["run"]["steps"] == [30, 39]
    assert [f["ranks"] for f in last["findings"] if f["kind"] == "straggler"] == [[5]]
    bad = megascope("analyze", run_dir, "--last", "5", "--steps", "1:4", check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_cut_and_timeline():
    assert cut(0, 9, 4) == [(0, 3), (4, 7), (8, 9)]  # a last window of 2 steps or more stays
    assert cut(0, 10, 5) == [(0, 4), (5, 10)]  # one of a single step joins the one before
    f = {"kind": "straggler", "ranks": [1], "severity": 0.2}
    windows = [
        {"steps": [0, 9], "findings": [f]},
        {"steps": [10, 19], "findings": []},
        {"steps": [20, 29], "findings": [f]},
    ]
    got = [(e["first_step"], e["last_step"]) for e in timeline(windows)]
    assert got == [(0, 9), (20, 29)]  # a fault that returns is a new entry


def test_fleet_on_dask_equals_local(cluster, fault_runs):
    runs = [fault_runs["slow_rank"], fault_runs["hang"], fault_runs["slow_link"]]
    local = json.loads(megascope("fleet", *runs, "--json", "--no-whatif").stdout)
    dask = json.loads(
        megascope("fleet", *runs, "--json", "--no-whatif", "--engine", "dask",
                  "--scheduler", cluster[1]).stdout
    )  # fmt: skip
    assert dask["engine"]["name"] == "dask"
    assert {k: v for k, v in dask.items() if k != "engine"} == local
    assert [r["run"] for r in local["runs"]] == runs
