"""The tracer's writer pieces on their own: buffers, timestamp resolution, compaction, py-spy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

import tracer
from tracer.config import TracerConfig
from tracer.watchdog import dump_own_stacks, parse_pyspy
from tracer.writer import Buffer, PartWriter, to_columns


def test_buffer_drops_and_counts_past_its_cap():
    buf = Buffer(cap=3)
    for i in range(5):
        buf.add((i,))
    assert buf.drain() == [(0,), (1,), (2,)] and buf.dropped == 2
    buf.add((9,))
    assert buf.drain() == [(9,)]


class PendingEvent:
    """Stands in for a CUDA event (no GPU here): resolution only reads query()."""

    def __init__(self, done: bool, ns: int) -> None:
        self.done, self.ns = done, ns

    def query(self) -> bool:
        return self.done


def test_to_columns_applies_the_offset_and_defers_or_nulls_unresolved_times():
    def resolve(ev: PendingEvent) -> int | None:
        return ev.ns if ev.query() else (None if ev.ns >= 0 else -1)

    rows = [
        (0, -1, "fwd", "compute", 100, 200, "host", 90),
        (0, -1, "bwd", "compute", PendingEvent(True, 300), PendingEvent(False, 400), "cuda", None),
        (0, -1, "opt", "compute", PendingEvent(True, 500), PendingEvent(False, -1), "cuda", None),
    ]
    cols, deferred = to_columns("spans", rows, 7, 1000, resolve)
    assert cols["rank"] == [7, 7]
    assert cols["name"] == ["fwd", "opt"]
    assert cols["start_ns"] == [1100, 1500] and cols["end_ns"] == [1200, None]
    assert cols["cpu_ns"] == [90, None]  # a CPU time is a length: no offset
    assert deferred == [rows[1]]


def test_compaction_merges_parts_without_losing_rows(tmp_path):
    writer = PartWriter(str(tmp_path), 3)
    for step in range(5):
        writer.write(
            "heartbeats", {"rank": [3], "ts_ns": [step], "step": [step], "state": ["step"]}
        )
    folder = tmp_path / "heartbeats" / "rank=00003"
    assert len(os.listdir(folder)) == 5
    assert writer.compact("heartbeats", 8) is None  # below the threshold: untouched
    merged = writer.compact("heartbeats", 2)
    assert os.listdir(folder) == ["comp-000000.parquet"] and merged.endswith("comp-000000.parquet")
    assert pq.read_table(merged).column("step").to_pylist() == [0, 1, 2, 3, 4]
    writer.write("heartbeats", {"rank": [3], "ts_ns": [5], "step": [5], "state": ["end"]})
    assert sorted(os.listdir(folder)) == ["comp-000000.parquet", "part-000005.parquet"]


def test_parse_pyspy_of_a_real_dump():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\ndef napping():\n    time.sleep(60)\nnapping()"]
    )
    try:
        time.sleep(1.0)
        exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
        out = subprocess.run([exe, "dump", "--pid", str(child.pid)], capture_output=True, text=True)
    finally:
        child.kill()
        child.wait()
    threads = parse_pyspy(out.stdout)
    assert len(threads) == 1
    header, stack = threads[0]
    assert header.startswith(f"{child.pid} (idle)")  # the main thread: its id is the pid
    assert stack.splitlines()[0].startswith("napping (<string>:3)")


def test_own_stacks_name_this_test():
    threads = dump_own_stacks()
    assert any("test_own_stacks_name_this_test" in stack for _, stack in threads)


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("MEGASCOPE_HANG_TIMEOUT", "7.5")
    monkeypatch.setenv("MEGASCOPE_FLUSH_STEPS", "3")
    cfg = TracerConfig.from_env(TracerConfig(nvml_hz=0))
    assert (cfg.hang_timeout_s, cfg.flush_every_steps, cfg.nvml_hz) == (7.5, 3, 0)
    monkeypatch.setenv("MEGASCOPE_FLUSH_STEPS", "often")
    with pytest.raises(ValueError, match="MEGASCOPE_FLUSH_STEPS='often'"):
        TracerConfig.from_env()


def _disk_full(rank: int, world: int, run: str) -> tuple[bool, float, int]:
    """The run directory breaks mid-run: the next flush fails, tracing stops, training goes on."""
    tr = tracer.attach(run, config=TracerConfig(hang_timeout_s=0, flush_every_s=60))
    t = torch.ones(1)
    for step in range(3):
        tracer.step(step)
        dist.all_reduce(t)
    spans = os.path.join(run, "spans")
    os.rename(run, run + ".gone")
    with open(run, "w") as f:  # the run directory is now a file: every write fails
        f.write("x")
    for step in range(3, 6):
        tracer.step(step)
        with tracer.span("forward"):
            dist.all_reduce(t)
    tracer.close()
    return tr.enabled, float(t[0]), int(os.path.exists(spans))


def test_write_failure_mid_run_turns_tracing_off(tmp_path, ranks):
    assert ranks(_disk_full, 1, str(tmp_path / "run")) == [(False, 1.0, 0)]


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "name a script or -m MODULE"),
        (["script.py"], "no run directory: pass --out RUN or set MEGASCOPE_TRACE"),
        (["--out", "r", "no/such/script.py"], "no such script: no/such/script.py"),
    ],
)
def test_tracer_run_bad_input_is_one_line_and_exit_2(argv, message):
    env = {k: v for k, v in os.environ.items() if k != "MEGASCOPE_TRACE"}
    done = subprocess.run(
        [sys.executable, "-m", "tracer.run", *argv], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"python -m tracer.run: error: {message}"]


def test_tracer_stacks_bad_input_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tracer.stacks", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"python -m tracer.stacks: error: {tmp_path}: no topology rows (is a traced job running there?)"
    ]
