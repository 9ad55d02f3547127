"""``megascope train`` end to end: real torchrun, real gloo ranks, real run directories."""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import pytest
from helpers.cli import run_main

from trainer import progress
from trainer.cliconfig import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACED = os.path.exists(os.path.join(ROOT, "tracer", "api.py"))
TRACE_FLAGS = [] if TRACED else ["--no-trace"]


def _meta(run: str) -> dict:
    with open(os.path.join(run, "run.json"), encoding="utf-8") as f:
        return json.load(f)


def _rows(run: str, table: str, sql: str) -> list[tuple]:
    files = glob.glob(os.path.join(run, table, "*", "*.parquet"))
    if not files:
        return []
    query = "with t as (select * from read_parquet($files, hive_partitioning=false)) " + sql
    return duckdb.connect().execute(query, {"files": files}).fetchall()


def _iso_ns(text: str) -> int:
    return int(dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1e9)


def test_eight_ranks_dp_pp_tp_sp_finish_with_falling_loss(tmp_path, train):
    run = str(tmp_path / "run")
    res = train(
        "--dp", "2", "--pp", "2", "--tp", "2", "--sp", "--steps", "16",
        "--device", "cpu", "--out", run, *TRACE_FLAGS,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    meta = _meta(run)
    assert meta["status"] == "finished" and meta["ended_at"] and meta["world_size"] == 8
    assert meta["mesh"] == {"dp": 2, "pp": 2, "tp": 2, "cp": 1}
    assert len(meta["groups"]) == 12 and meta["injections"] == []
    assert meta["model"]["params"] > 0 and meta["model"]["flops_per_token"] > 0
    assert meta["versions"]["torch"] and meta["device"] == "cpu"
    s = meta["summary"]
    assert s["steps"] == 16 and s["median_step_ms"] > 0 and s["tokens_per_s"] > 0
    assert s["mfu"] is None  # no known peak on a CPU
    losses = [r["loss"] for r in progress.read_steps(run)]
    assert len(losses) == 16 and s["loss_first"] == losses[0] and s["loss_last"] == losses[-1]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    if TRACED:
        ranks = _rows(run, "spans", "select distinct rank from t order by rank")
        assert [r for (r,) in ranks] == list(range(8))


def test_injected_crash_ends_the_run_failed(tmp_path, train):
    run = str(tmp_path / "run")
    res = train(
        "--dp", "2", "--steps", "8", "--out", run, "--inject", "crash:rank=1,step=2",
        *TRACE_FLAGS,
    )  # fmt: skip
    assert res.returncode != 0
    meta = _meta(run)
    assert meta["status"] == "failed" and meta["ended_at"]
    assert meta["injections"] == ["crash:rank=1,step=2"]
    assert meta["summary"]["steps"] == 2  # steps 0 and 1 finished, step 2 never did


@pytest.mark.parametrize("traced", [TRACED, False], ids=["traced", "untraced"])
def test_injected_hang_ends_the_run_hung_with_a_stack_of_the_hung_rank(tmp_path, traced, train):
    """Traced, the tracer's watchdog records the stacks; untraced, the launcher's py-spy."""
    run, timeout = str(tmp_path / "run"), 6
    res = train(
        "--dp", "2", "--steps", "30", "--out", run, "--hang-timeout", str(timeout),
        "--inject", "hang:rank=1,step=3", *([] if traced else ["--no-trace"]),
    )  # fmt: skip
    assert res.returncode != 0
    meta = _meta(run)
    assert meta["status"] == "hung" and meta["summary"]["steps"] == 3
    # ended within the timeout plus a few seconds of the hung rank's last progress
    last = progress.read_ranks(run)[1]
    assert last.step == 2
    assert (_iso_ns(meta["ended_at"]) - last.ns) / 1e9 < timeout + 10
    stacks = _rows(run, "stacks", "select rank, stack from t where rank = 1")
    assert stacks and any("trainer/faults/rank.py" in s for _, s in stacks), stacks
    if not traced:
        parts = os.listdir(os.path.join(run, "stacks", "rank=00001"))
        assert parts and all(p.startswith("launcher-") for p in parts), parts


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "config.toml"
    path.write_text(text.replace(";", "\n"))
    return str(path)


BAD = [
    ["--dp", "0"],
    ["--tp", "3"],
    ["--pp", "5"],
    ["--cp", "3"],
    ["--tp", "2", "--cp", "4"],
    ["--steps", "ten"],
    ["--device", "tpu"],
    ["--hang-timeout", "0"],
    ["--frobnicate"],
    ["--model", "huge"],
    ["--config", "no-such-file.toml"],
    ["--config", "TOML:[model];n_head = 3"],
    ["--config", "TOML:[model];n_layers = 3"],
    ["--config", "TOML:[bogus];x = 1"],
    ["--config", "TOML:[run];inject = 'hang:rank=0,step=1'"],
    ["--config", "TOML:[run];inject = ['hang:rank=5,step=1']"],
    ["--config", "TOML:[run];hang_timeout = 'soon'"],
    ["--config", "TOML:[run];outdir = 'x'"],
    ["--config", "TOML:[model;"],
    ["--dp", "2", "--inject", "slow_rank:rank=2,factor=2"],
    ["--inject", "bogus:rank=0"],
    ["--inject", "hang:rank=0"],
    ["--inject", "slow_link:ranks=0-0,factor=2", "--dp", "2"],
    ["--inject", "pause:rank=0,every=0,ms=5"],
    ["--resume"],
]


@pytest.mark.parametrize("args", BAD, ids=[" ".join(a) for a in BAD])
def test_bad_flags_exit_2_with_one_line(tmp_path, args):
    args = [_toml(tmp_path, a[5:]) if a.startswith("TOML:") else a for a in args]
    run = str(tmp_path / "run")
    res = run_main("train", *args, "--out", run)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "error" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert not os.path.exists(os.path.join(run, "run.json"))


def test_existing_run_needs_resume(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    res = run_main("train", "--out", str(run))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--resume" in res.stderr


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "configs"))))
def test_example_configs_validate(tmp_path, name):
    cfg = resolve(["--config", os.path.join(ROOT, "configs", name), "--device", "cpu",
                   "--out", str(tmp_path)])  # fmt: skip
    assert cfg.world_size >= 1 and cfg.train.steps >= 1


def test_ctrl_c_tears_the_ranks_down_and_marks_the_run_failed(tmp_path, launch):
    run = str(tmp_path / "run")
    proc = launch(
        [sys.executable, "-m", "analyzer", "train", "--dp", "2", "--steps", "100000",
         "--out", run, "--no-trace"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while len(progress.read_steps(run)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        pids = [line.pid for line in progress.read_ranks(run).values()]
        assert len(pids) == 2
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert code == 130
    meta = _meta(run)
    assert meta["status"] == "failed" and meta["ended_at"] and meta["summary"]["steps"] >= 2
    for pid in pids:  # no rank outlives the launcher
        assert not _alive(pid), pid


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    """Running, not a zombie. A process can end between looking for it and reading its state:
    gone is not alive."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_launcher_killed_with_sigkill_leaves_no_rank_behind(tmp_path, launch):
    run = str(tmp_path / "run")
    proc = launch(
        [sys.executable, "-m", "analyzer", "train", "--dp", "2", "--steps", "100000",
         "--out", run, "--no-trace"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while len(progress.read_steps(run)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.2)
        ranks = [line.pid for line in progress.read_ranks(run).values()]
        assert len(ranks) == 2 and all(_alive(p) for p in ranks)
        pids = ranks + [_ppid(ranks[0])]  # and torchrun
        proc.kill()  # SIGKILL: the launcher can end nothing itself
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]
    finally:
        for pid in pids if "pids" in locals() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
