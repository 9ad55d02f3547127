"""The tracer attached to an unmodified DDP script under torchrun, through MEGASCOPE_TRACE.

tests/scripts/tracer_ddp_script.py is a plain DDP script; ``python -m tracer.run`` attaches the tracer
right after its ``init_process_group``. These runs cover what only whole processes show: a
SIGKILLed rank's files, SIGTERM flushing, and a hang's stacks on the hung and the waiting ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pyarrow.parquet as pq
from helpers.live import wait_for
from helpers.paths import SCRIPTS
from helpers.tables import assert_seq_matches, read

from tracer.rundir import read_run_json

SCRIPT = os.path.join(SCRIPTS, "tracer_ddp_script.py")


def torchrun(attach_popen, run: str, nproc: int, *args: str, **env: str) -> subprocess.Popen:
    """torchrun -m tracer.run SCRIPT ARGS in its own session (so the test can end it all)."""
    return attach_popen(run, SCRIPT, *args, nproc=nproc, env=env)


def end_session(proc: subprocess.Popen, run: str) -> str:
    """End the torchrun we started and its workers, and return its output.

    torchrun starts its workers in sessions of their own, so they are ended by the pids the
    tracer wrote to topology (as the megascope launcher does), then torchrun's own group.
    """
    if proc.poll() is None:
        try:
            pids = [t["pid"] for t in read(run, "topology")]
        except Exception:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    return out


def reached(progress: str, rank: int, step: int) -> bool:
    """Whether the script's progress file says ``rank`` has begun ``step``."""
    try:
        with open(f"{progress}.{rank}") as f:
            return int(f.read() or -1) >= step
    except (OSError, ValueError):
        return False


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by torchrun counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_unmodified_ddp_script_through_env_variable(tmp_path, attach_popen):
    """No tracer call in the script: DDP's own collectives (its gradients' all-reduce timed
    through the tracer's comm hook, its bucket rebuild's broadcast from Flight Recorder, untimed
    on gloo), the script's (through the wrappers), steps and spans (the automatic ones)."""
    run = str(tmp_path / "run")
    proc = torchrun(attach_popen, run, 2, "--steps", "4")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    rows = read(run, "collectives")
    assert_seq_matches(rows)
    grads = 4 * (16 * 32 + 32 + 32 + 1)  # the model's parameters, float32: one DDP bucket
    for rank in (0, 1):
        mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["issue_ns"])
        init = [r["op"] for r in mine if r["step"] == -1]
        assert init and set(init) <= {"all_gather", "broadcast"}, init  # DDP's set-up
        # DDP rebuilds its buckets once, then tells the others their order: Flight Recorder's
        # rows, untimed on gloo, in the step whose window their time falls in (the first or
        # second: on busy cores the read lags)
        rebuilt = [
            (r["op"], r["step"]) for r in mine if r["source"] == "untimed" and r["step"] >= 0
        ]
        assert rebuilt and {op for op, _ in rebuilt} == {"broadcast"}, rebuilt
        assert {step for _, step in rebuilt} <= {0, 1, 2}, rebuilt
        for step in range(4):
            got = sorted((r["op"], r["source"], r["nbytes"]) for r in mine if r["step"] == step)
            got = [g for g in got if g[:2] != ("broadcast", "untimed")]
            want = [("all_reduce", "host", 4), ("all_reduce", "host", grads)]
            want += [("broadcast", "host", 8)]  # a float32 loss, DDP's gradients, an int64 step
            assert got == sorted(want + ([("barrier", "host", 0)] if step == 3 else [])), got
    assert {r["group"] for r in rows} == {"dp"}  # DDP names the default group
    spans = read(run, "spans", "rank = 0")
    for name in ("forward", "backward", "optimizer", "step"):
        assert sorted(s["step"] for s in spans if s["name"] == name) == [0, 1, 2, 3], name
    meta = read_run_json(run)
    assert (meta["status"], meta["world_size"]) == ("finished", 2)
    assert {g["name"] for g in meta["groups"]} == {"world", "dp"}
    assert [t["rank"] for t in read(run, "topology")] == [0, 1]


def test_sigkilled_rank_leaves_readable_files_up_to_the_last_flush(tmp_path, attach_popen):
    run, progress = str(tmp_path / "run"), str(tmp_path / "progress")
    proc = torchrun(attach_popen, run, 2, "--api", "--steps", "100000", "--step-sleep", "0.05",
                    "--progress", progress, MEGASCOPE_FLUSH_STEPS="5",
                    # the budget would widen the interval on busy cores, and the window a kill
                    # loses with it (up to 8x): this test holds the configured one
                    MEGASCOPE_CPU_BUDGET="0")  # fmt: skip

    try:
        assert wait_for(lambda: reached(progress, 1, 23)), "rank 1 never reached step 23"
        pid = read(run, "topology", "rank = 1")[0]["pid"]
        os.kill(pid, signal.SIGKILL)  # the pid the tracer wrote at attach
        with open(f"{progress}.1") as f:
            last = int(f.read())
        assert wait_for(lambda: proc.poll() is not None, 120), "torchrun did not end"
    finally:
        out = end_session(proc, run)
    files = [os.path.join(d, f) for d, _, fs in os.walk(run) for f in fs if f.endswith(".parquet")]
    assert all(pq.read_table(f).num_rows > 0 for f in files), out
    for table in ("heartbeats", "spans", "collectives"):
        steps = sorted({r["step"] for r in read(run, table, "rank = 1 and step >= 0")})
        # at most the current flush interval lost, plus the one whose write was in progress:
        # killed in step 25, steps 20-24 may be in the writer and 25 in the buffer, so the
        # last step on disk is at least 19
        first_unsafe = (last // 5) * 5 - 5
        assert steps == list(range(len(steps))) and steps[-1] >= first_unsafe - 1, (table, last)
    # rank 0 was ended by torchrun's SIGTERM: its handler flushed and marked the run failed
    beats = read(run, "heartbeats", "rank = 0")
    assert beats[-1]["state"] == "end" and beats[-1]["step"] >= last - 1
    assert read_run_json(run)["status"] == "failed"


def test_hang_gives_stacks_of_the_hung_and_the_waiting_rank(tmp_path, attach_popen):
    run = str(tmp_path / "run")
    proc = torchrun(attach_popen, run, 2, "--api", "--steps", "10", "--hang-rank", "1", "--hang-step", "3",
                    MEGASCOPE_HANG_TIMEOUT="3")  # fmt: skip
    try:
        found = wait_for(
            lambda: (
                all(os.path.isdir(f"{run}/stacks/rank={r:05d}") for r in (0, 1))
                and len(read(run, "heartbeats", "state = 'hang' and step = 3")) == 2
                # the owner marks run.json after its flush: wait for that before ending the run
                and read_run_json(run)["status"] == "hung"
            )
        )
    finally:
        out = end_session(proc, run)
    assert found, out
    stacks = read(run, "stacks")
    assert {s["reason"] for s in stacks} == {"hang"}
    # the last dump of each rank (a slow start-up step on a loaded machine may add earlier ones)
    main = {s["rank"]: s["stack"] for s in stacks if "MainThread" in s["thread"]}
    assert "all_reduce" in main[0] and "tracer_ddp_script.py" in main[0]
    assert "all_reduce" not in main[1] and "tracer_ddp_script.py" in main[1]
    waiting = read(run, "collectives", "end_ns is null")
    assert [(w["rank"], w["op"], w["step"]) for w in waiting] == [(0, "all_reduce", 3)]
    seq = waiting[0]["seq"]
    assert not read(run, "collectives", f"rank = 1 and op = 'all_reduce' and seq = {seq}")
    assert read_run_json(run)["status"] == "hung"


def test_a_hang_stays_the_diagnosis_when_the_hung_rank_dies_later(tmp_path, attach_popen):
    """Both ranks record the hang; rank 1 then dies while rank 0 is still in its grace, so
    gloo raises in rank 0's all_reduce and its script ends on an uncaught error. The run was
    hung first: the error is the consequence, and run.json keeps "hung"."""
    run = str(tmp_path / "run")
    proc = torchrun(attach_popen, run, 2, "--api", "--steps", "10", "--hang-rank", "1", "--hang-step", "3",
                    "--hang-seconds", "10", MEGASCOPE_HANG_TIMEOUT="2",
                    MEGASCOPE_HANG_GRACE="60")  # fmt: skip
    try:
        assert wait_for(lambda: proc.poll() is not None, 120), "torchrun did not end"
    finally:
        out = end_session(proc, run)
    assert len(read(run, "heartbeats", "state = 'hang' and step = 3")) == 2, out
    beats = read(run, "heartbeats", "rank = 0")
    assert beats[-1]["state"] == "end", out  # rank 0 closed on its error, not after its grace
    assert read_run_json(run)["status"] == "hung", out


def test_sigterm_flushes_a_rank_blocked_in_a_collective(tmp_path, attach_popen):
    """Rank 0 waits in gloo (C code, where no Python signal handler runs) for rank 1, which
    sleeps; a SIGTERM to rank 0 still flushes its rows, the waited-in collective included."""
    run, progress = str(tmp_path / "run"), str(tmp_path / "progress")
    proc = torchrun(attach_popen, run, 2, "--api", "--steps", "10", "--hang-rank", "1", "--hang-step", "2",
                    "--progress", progress, MEGASCOPE_HANG_TIMEOUT="0")  # fmt: skip
    try:
        assert wait_for(lambda: reached(progress, 0, 2) and reached(progress, 1, 2))
        time.sleep(2.0)  # margin for rank 0 to get from its optimizer into the all_reduce
        pid = read(run, "topology", "rank = 0")[0]["pid"]
        os.kill(pid, signal.SIGTERM)
        assert wait_for(lambda: gone(pid), 60), "rank 0 did not exit on SIGTERM"
    finally:
        out = end_session(proc, run)
    assert "SIGTERM while the main thread is blocked" in out  # the watchdog thread's path
    beats = read(run, "heartbeats", "rank = 0")
    assert (beats[-1]["state"], beats[-1]["step"]) == ("end", 2), out
    waiting = read(run, "collectives", "rank = 0 and end_ns is null")
    assert [(w["op"], w["step"]) for w in waiting] == [("all_reduce", 2)]
    assert read_run_json(run)["status"] == "failed"
