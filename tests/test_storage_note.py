"""analyze's ``storage`` note (issue 48): one line on what a run cut off by its storage is
missing, and silence for a healthy finished run and for a run whose launcher still trains (what
a watch reads)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from helpers.synth import synth_run

from analyzer.db import open_run
from analyzer.findings import storage
from analyzer.synth import Extras
from tracer import rundir

MESH = {"dp": 2, "pp": 1, "tp": 1, "cp": 1}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> str:
    """A synthesized healthy run of 2 ranks and 12 steps (its status: finished), made once."""
    path = str(tmp_path_factory.mktemp("storage_note") / "run")
    synth_run(path, mesh=MESH, steps=12, seed=1, extras=Extras())
    return path


@pytest.fixture
def run(healthy, tmp_path) -> str:
    """This test's own copy of the healthy run."""
    return shutil.copytree(healthy, str(tmp_path / "run"))


def _meta(path: str, **change) -> None:
    with open(os.path.join(path, "run.json"), encoding="utf-8") as f:
        meta = json.load(f)
    meta.update(change)
    rundir.write_json_atomic(os.path.join(path, "run.json"), meta)


def _claim(path: str, pid: int) -> None:
    os.makedirs(os.path.join(path, ".progress"), exist_ok=True)
    with open(os.path.join(path, storage.CLAIM), "w", encoding="utf-8") as f:
        json.dump({"node": 0, "host": socket.gethostname(), "pid": pid}, f)


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def _note(path: str):
    r = open_run(path)
    try:
        return storage.note(r)
    finally:
        r.close()


def test_a_healthy_finished_run_has_no_note(run):
    _claim(run, _dead_pid())
    _meta(run, train={"steps": 40})
    assert _note(run) is None


def test_a_run_whose_launcher_still_trains_has_no_note(run):
    _meta(run, status="running", train={"steps": 40})
    assert _note(run) is None  # no claim: a script under torchrun, maybe still training
    _claim(run, os.getpid())  # a launcher alive on this host
    assert _note(run) is None


def test_a_run_whose_launcher_ended_unrecorded_says_what_is_missing(run):
    _meta(run, status="running", train={"steps": 40})
    _claim(run, _dead_pid())
    note = _note(run)
    assert note is not None and note["kind"] == "storage"
    assert "no recorded end" in note["message"] and "rank 0 from step 12" in note["message"]
    assert "\n" not in note["message"]


def test_storage_failed_names_the_rank_path_and_error(run):
    failure = {"rank": 1, "writer": "tracer", "path": f"{run}/spans/rank=00001",
               "error": "ENOENT: No such file or directory", "step": 5}  # fmt: skip
    _meta(run, storage_failed=[failure], checkpoints_missing={"10": ["rank 1: ENOSPC"]})
    note = _note(run)
    assert note is not None and note["ranks"] == [1]
    assert "rank 1 from step 12" in note["message"] and "checkpoints at steps 10" in note["message"]
    assert "ENOENT" in note["message"] and "spans/rank=00001" in note["message"]


def test_the_reserved_record_stands_for_an_unwritable_run_json(run):
    rundir.reserve_status(run)
    failure = {"rank": 0, "writer": "progress", "path": f"{run}/.progress/rank-00000",
               "error": "ENOSPC: No space left on device", "step": 7}  # fmt: skip
    assert rundir.write_reserved(run, {"status": "finished", "storage_failed": [failure]})
    note = _note(run)
    assert note is not None and "ENOSPC" in note["message"]
