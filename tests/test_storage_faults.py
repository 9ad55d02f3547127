"""megascope's own storage faults never reach the training (issue 48), on real filesystems: a
small tmpfs filled to the last byte, the run directory remounted read-only, a rank's folder
removed, each while two ranks train. Each training exits 0 with the losses of a run on a
normal disk, prints no traceback and one line per failed writer per rank; ``analyze`` answers
from what was written and says in one line what is missing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import pytest
from helpers.cli import megascope
from helpers.live import wait_for
from helpers.paths import ROOT
from helpers.storage import fill, losses, off_lines, remount_ro, steps_logged, tmpfs

pytestmark = pytest.mark.live  # also implied: every test takes ``launch`` or ``attach_popen``

STEPS = "14"
# every rank pauses at every third step: the test has time to break the disk mid-run
ARGS = ("--dp", "2", "--steps", STEPS, "--device", "cpu", "--checkpoint-every", "5",
        "--inject", "pause:rank=0,every=3,ms=400", "--inject", "pause:rank=1,every=3,ms=400")  # fmt: skip
ENV = {**os.environ, "MEGASCOPE_FLUSH_STEPS": "2", "PYTHONPATH": ROOT}


def _start(launch: Callable[..., subprocess.Popen], out: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "analyzer", "train", *ARGS, "--out", out]
    return launch(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    return out


@pytest.fixture(scope="module")
def normal(tmp_path_factory, launch) -> str:
    """What the same training prints on a normal disk."""
    return _finish(_start(launch, str(tmp_path_factory.mktemp("normal") / "run")))


def _check(out: str, normal: str, run: str) -> list[tuple[int, str, str, str]]:
    assert losses(out) == losses(normal) and losses(out), (losses(out), losses(normal))
    offs = off_lines(out)
    per = Counter((rank, writer) for rank, writer, _, _ in offs)
    assert all(n == 1 for n in per.values()), offs
    res = megascope("analyze", run, "--no-whatif")
    assert res.returncode == 0, res.stderr[-2000:]
    missing = [ln for ln in res.stdout.splitlines() if "missing" in ln]
    assert len(missing) == 1, res.stdout
    assert re.search(r"from step \d+", missing[0]), missing[0]
    return offs


def test_trainer_on_a_full_disk(tmp_path, normal, launch):
    with tmpfs(str(tmp_path / "disk"), "48m") as disk:
        run = os.path.join(disk, "run")
        proc = _start(launch, run)
        assert wait_for(lambda: steps_logged(run) >= 3, timeout=240, every=0.1)
        fill(disk)
        out = _finish(proc)
        offs = _check(out, normal, run)
        assert {e for *_, e in offs} == {"ENOSPC"}, offs
        assert {r for r, *_ in offs} == {0, 1}, offs
        assert "storage_failed" in out


def test_trainer_on_a_run_directory_made_read_only(tmp_path, normal, launch):
    with tmpfs(str(tmp_path / "disk"), "64m") as disk:
        run = os.path.join(disk, "run")
        proc = _start(launch, run)
        assert wait_for(lambda: steps_logged(run) >= 3, timeout=240, every=0.1)
        remount_ro(disk)
        out = _finish(proc)
        offs = _check(out, normal, run)
        assert {e for *_, e in offs} == {"EROFS"}, offs


def test_trainer_with_a_rank_folder_removed(tmp_path, normal, launch):
    run = str(tmp_path / "run")
    proc = _start(launch, run)
    spans = os.path.join(run, "spans", "rank=00001")
    assert wait_for(lambda: os.path.isdir(spans) and steps_logged(run) >= 3, timeout=240, every=0.1)
    shutil.rmtree(spans)
    out = _finish(proc)
    offs = _check(out, normal, run)
    assert [(r, w) for r, w, *_ in offs] == [(1, "tracer")], offs
    with open(os.path.join(run, "run.json"), encoding="utf-8") as f:
        assert '"storage_failed"' in f.read()


def test_attached_ddp_script_on_a_full_disk(tmp_path, attach_popen):
    env = {"MEGASCOPE_FLUSH_STEPS": "2"}
    args = ("--steps", "30", "--dim", "64", "--layers", "1", "--seq", "32")
    base = attach_popen(str(tmp_path / "normal"), "ddp.py", *args, env=env)
    normal_out, _ = base.communicate(timeout=400)
    assert base.returncode == 0, normal_out[-3000:]
    with tmpfs(str(tmp_path / "disk"), "48m") as disk:
        run = os.path.join(disk, "run")
        proc = attach_popen(run, "ddp.py", *args, env=env)
        hb = os.path.join(run, "heartbeats", "rank=00001")
        assert wait_for(
            lambda: os.path.isdir(hb) and len(os.listdir(hb)) > 0, timeout=240, every=0.1
        )
        fill(disk)
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
        last = re.findall(r"last loss (\S+)", out)
        assert last and last == re.findall(r"last loss (\S+)", normal_out), out[-2000:]
        per = Counter((r, w) for r, w, *_ in off_lines(out))
        assert per and all(n == 1 for n in per.values()), out[-3000:]
        res = megascope("analyze", run, "--no-whatif")
        assert res.returncode == 0, res.stderr[-2000:]
        assert len([ln for ln in res.stdout.splitlines() if "missing" in ln]) == 1, res.stdout
