"""A run split by a checkpoint and ``--resume`` trains exactly like an uninterrupted one."""

from __future__ import annotations

import json
import os

import pytest
from helpers.cli import assert_one_line_error, run_main

from trainer import progress
from trainer.checkpoint import latest_complete

COMMON = ["--dp", "2", "--pp", "2", "--steps", "6", "--checkpoint-every", "3", "--no-trace"]


def test_six_steps_straight_equal_three_plus_resume_plus_three(tmp_path, train):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    res = train(*COMMON, "--out", straight)
    assert res.returncode == 0, res.stderr[-3000:]
    res = train(*COMMON, "--stop-after", "3", "--out", split)
    assert res.returncode == 0, res.stderr[-3000:]
    assert latest_complete(split, 4) == 3
    assert [s["step"] for s in progress.read_steps(split)] == list(range(3))
    res = train(*COMMON, "--resume", "--out", split)
    assert res.returncode == 0, res.stderr[-3000:]

    a, b = progress.read_steps(straight), progress.read_steps(split)
    assert [s["step"] for s in a] == [s["step"] for s in b] == list(range(6))
    assert a[-1]["loss"] < a[0]["loss"]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6, rel=0), (x, y)
    assert b[3]["first"]  # step 3 really ran in a new process
    with open(os.path.join(split, "run.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["status"] == "finished" and meta["resumed_from_step"] == 3
    assert meta["summary"]["steps"] == 6
    assert meta["summary"]["loss_last"] == pytest.approx(a[-1]["loss"], abs=1e-6)
    # every shard of both checkpoints is there, with its completion marker
    assert latest_complete(split, 4) == 6
    shards = sorted(os.listdir(os.path.join(split, "checkpoints", "step-000003")))
    assert shards == ["complete"] + [f"rank-{r:05d}" for r in range(4)]


def test_resume_without_checkpoint_is_a_one_line_error(tmp_path):
    run = str(tmp_path / "none")
    os.makedirs(run)
    assert_one_line_error(
        run_main("train", "--dp", "2", "--resume", "--out", run), "no run to resume"
    )
