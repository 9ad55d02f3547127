"""Each of megascope's writers turns itself off on a real storage fault (issue 48): a tmpfs
remounted read-only, filled to the last byte, or a folder removed under it. One line per writer,
nothing raised, the launcher told over the beacon. (Root ignores chmod: the faults here are real
filesystems', not permissions'.) A stalled disk is a FIFO with no reader, whose open for write
blocks in the OS: the progress writer's training-thread side goes on. No rank starts."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.storage import fill, remount_ro, tmpfs

from tracer import beacon, rundir
from tracer.config import TracerConfig
from tracer.core import Tracer
from tracer.writer import PartWriter
from trainer import progress


@pytest.fixture
def disk(tmp_path) -> Iterator[str]:
    """A 4 MiB tmpfs of this test's own (skips where it cannot be mounted)."""
    with tmpfs(str(tmp_path / "disk"), "4m") as path:
        yield path


@pytest.fixture
def listener() -> Iterator[beacon.Listener]:
    """The launcher's side of the beacon, on 127.0.0.1."""
    ear = beacon.Listener()
    yield ear
    ear.close()


def _heard(ear: beacon.Listener, want: int) -> list[dict]:
    got: list[dict] = []
    deadline = time.monotonic() + 2.0
    while len(got) < want and time.monotonic() < deadline:
        got += ear.drain()
        time.sleep(0.01)
    return got


def _off_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "writer off" in r.getMessage()]


def test_progress_writer_on_a_read_only_disk_says_one_line_and_keeps_sending(
    disk, listener, caplog
):
    run = os.path.join(disk, "run")
    os.makedirs(progress.progress_dir(run))
    writer = progress.ProgressWriter(run, 1, beacon.Sender(listener.address))
    writer.rank_line(0, "step")
    assert writer.flush(10.0)
    assert progress.read_ranks(run)[1].step == 0
    remount_ro(disk)
    with caplog.at_level(logging.WARNING, "megascope.rank"):
        for step in range(1, 4):
            writer.rank_line(step, "step")
            writer.step_record({"step": step, "loss": 1.0})
            writer.flush(10.0)  # each step's writes done: the failure names step 1
        assert not writer.close()
    assert not writer.on and writer.failure is not None
    assert writer.failure.error.startswith("EROFS") and writer.failure.step == 1
    lines = _off_lines(caplog)
    assert len(lines) == 1 and "rank 1: progress writer off at step 1" in lines[0], lines
    heard = _heard(listener, 5)
    assert [m["line"].split()[1] for m in heard if "line" in m] == ["0", "1", "2", "3"]
    failed = [m["storage_failed"] for m in heard if "storage_failed" in m]
    assert failed == [writer.failure.as_dict()]


def test_progress_writer_with_its_folder_removed_turns_off(tmp_path, caplog):
    run = str(tmp_path / "run")
    os.makedirs(progress.progress_dir(run))
    writer = progress.ProgressWriter(run, 0, beacon.Sender(""))
    writer.rank_line(0, "step")
    assert writer.flush(10.0)
    shutil.rmtree(run)
    with caplog.at_level(logging.WARNING, "megascope.rank"):
        writer.rank_line(1, "step")
        writer.memory({"bytes": 1})
        writer.close(10.0)
    assert writer.failure is not None and writer.failure.error.startswith("ENOENT")
    assert len(_off_lines(caplog)) == 1 and not os.path.exists(run)


def _stall(run: str, rank: int) -> str:
    """Rank ``rank``'s line is written through ``rank-R.tmp``: made a FIFO with no reader,
    opening it for write blocks in the OS (as a hung mount or a saturated disk holds a write)
    until a reader opens it."""
    fifo = os.path.join(progress.progress_dir(run), f"rank-{rank:05d}.tmp")
    os.mkfifo(fifo)
    return fifo


def _taken(writer: progress.ProgressWriter) -> bool:
    """Whether the writer thread took what it was handed (and is writing it)."""
    deadline = time.monotonic() + 10.0
    while writer.owed() and time.monotonic() < deadline:
        time.sleep(0.01)
    return writer.owed() == 0


def _steps(writer: progress.ProgressWriter, steps: range) -> bool:
    """The training thread's side of ``steps`` steps, in a thread of its own: whether they
    returned (a generous bound: a write that held them would hold them for good)."""
    runner = threading.Thread(target=lambda: [
        (writer.rank_line(s, "step"), writer.step_record({"step": s, "loss": 1.0})) for s in steps
    ], daemon=True)  # fmt: skip
    runner.start()
    runner.join(10.0)
    return not runner.is_alive()


def test_a_stalled_write_holds_no_step_and_the_newest_line_follows(tmp_path, listener):
    run = str(tmp_path / "run")
    os.makedirs(progress.progress_dir(run))
    fifo = _stall(run, 0)
    writer = progress.ProgressWriter(run, 0, beacon.Sender(listener.address), queue=2)
    writer.rank_line(0, "ready")
    assert _taken(writer)  # the writer thread now blocks opening the FIFO
    assert _steps(writer, range(1, 6))
    assert writer.owed() == 3 and writer.dropped == 3  # the newest line, two records queued
    assert not writer.flush(0.1)
    # the launcher heard every line while the disk stalled: the rank is not taken for hung
    assert [m["line"].split()[1] for m in _heard(listener, 6)] == ["0", "1", "2", "3", "4", "5"]
    with open(fifo, encoding="ascii") as f:  # a reader: the stall clears
        assert f.read().split()[1:2] == ["0"]
    assert writer.flush(10.0) and writer.on
    assert progress.read_ranks(run)[0].step == 5  # newest wins: lines 1-4 were never written
    assert [r["step"] for r in progress.read_steps(run)] == [1, 2]
    assert writer.close()


def test_close_on_a_stalled_disk_waits_a_bounded_time_and_says_the_drops(tmp_path, caplog):
    run = str(tmp_path / "run")
    os.makedirs(progress.progress_dir(run))
    fifo = _stall(run, 0)
    writer = progress.ProgressWriter(run, 0, beacon.Sender(""), queue=1)
    writer.rank_line(0, "ready")
    assert _taken(writer)
    assert _steps(writer, range(1, 3))
    with caplog.at_level(logging.WARNING, "megascope.rank"):
        assert not writer.close(0.1)  # the stalled write is left to the writer's own thread
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"megascope: rank 0: 1 step records not written to "
        f"{os.path.join(run, '.progress', 'steps.jsonl')} (the disk was too slow)"
    ], said
    writer.rank_line(3, "step")  # after close: nothing more is taken
    with open(fifo, encoding="ascii") as f:
        f.read()
    assert writer.flush(10.0)  # what was owed at close is still written once the stall clears
    assert progress.read_ranks(run)[0].step == 2
    assert [r["step"] for r in progress.read_steps(run)] == [1]


def test_part_writer_never_recreates_a_removed_rank_folder(tmp_path):
    writer = PartWriter(str(tmp_path), 1)
    cols = {"rank": [1], "ts_ns": [1], "step": [0], "state": ["step"]}
    first = writer.write("heartbeats", cols)
    assert first is not None and os.path.exists(first)
    shutil.rmtree(os.path.dirname(first))
    with pytest.raises(FileNotFoundError):
        writer.write("heartbeats", cols)
    assert not os.path.exists(os.path.dirname(first))


def _tracer(run: str) -> Tracer:
    return Tracer(run, rank=0, world=1, local_rank=0, mesh={}, config=TracerConfig())


def _span(tr: Tracer, step: int) -> None:
    tr.buffers["spans"].add((step, -1, "fwd", "compute", 100 + step, 200 + step, "host", 10))


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_tracer_flush_on_a_failed_disk_turns_writing_off_once(disk, listener, caplog, fault):
    run = os.path.join(disk, "run")
    os.makedirs(run)
    tr = _tracer(run)
    tr.digesting = False
    _span(tr, 0)
    tr.flush()
    if fault == "read-only":
        remount_ro(disk)
    else:
        fill(disk)
    os.environ[beacon.ENV] = listener.address
    try:
        beacon.reset_sender()
        with caplog.at_level(logging.WARNING, "megascope"):
            for step in range(1, 4):
                _span(tr, step)
                tr.flush()
    finally:
        del os.environ[beacon.ENV]
        beacon.reset_sender()
    assert not tr.writing and not tr.enabled
    want = "EROFS" if fault == "read-only" else "ENOSPC"
    assert tr.storage_failure.error.startswith(want) and tr.storage_failure.writer == "tracer"
    assert len(_off_lines(caplog)) == 1, caplog.text
    assert [m["storage_failed"]["error"].split(":")[0] for m in _heard(listener, 1)] == [want]
    assert tr.buffers["spans"].drain() == []  # drained by the flushes, and dropped


def test_reserved_status_is_written_on_a_full_disk(disk):
    run = os.path.join(disk, "run")
    os.makedirs(run)
    rundir.reserve_status(run)
    fill(disk)
    with pytest.raises(OSError) as err:
        rundir.write_json_atomic(os.path.join(run, "run.json"), {"status": "finished"})
    assert err.value.errno == errno.ENOSPC
    failure = beacon.StorageFailure(0, "tracer", run, "ENOSPC: No space left on device", 3)
    record = {"status": "finished", "storage_failed": [failure.as_dict()] * 400}
    assert rundir.write_reserved(run, record)
    kept = rundir.read_reserved(run)
    assert kept["status"] == "finished" and 0 < len(kept["storage_failed"]) < 400


def test_reserved_status_on_a_read_only_disk_is_not_written(disk):
    run = os.path.join(disk, "run")
    os.makedirs(run)
    rundir.reserve_status(run)
    remount_ro(disk)
    assert not rundir.write_reserved(run, {"status": "finished"})
    assert rundir.read_reserved(run) == {}


def test_describe_names_the_errno():
    assert beacon.describe(OSError(errno.ENOSPC, "No space left on device")) == (
        "ENOSPC: No space left on device"
    )
    assert beacon.describe(ValueError("bad\nmore")) == "ValueError: bad"
