"""Each of megascope's writers turns itself off on a real storage fault (issue 48): a tmpfs
remounted read-only, filled to the last byte, or a folder removed under it. One line per writer,
nothing raised, the launcher told over the beacon. (Root ignores chmod: the faults here are real
filesystems', not permissions'.) No rank starts."""

from __future__ import annotations

import errno
import logging
import os
import shutil
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
    assert progress.read_ranks(run)[1].step == 0
    remount_ro(disk)
    with caplog.at_level(logging.WARNING, "megascope.rank"):
        for step in range(1, 4):
            writer.rank_line(step, "step")
            writer.step_record({"step": step, "loss": 1.0})
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
    shutil.rmtree(run)
    with caplog.at_level(logging.WARNING, "megascope.rank"):
        writer.rank_line(1, "step")
        writer.memory({"bytes": 1})
    assert writer.failure is not None and writer.failure.error.startswith("ENOENT")
    assert len(_off_lines(caplog)) == 1 and not os.path.exists(run)


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
