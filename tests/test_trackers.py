"""``--log-to tensorboard|mlflow|wandb`` (analyzer/trackers/): the findings and per-step scores
of the slow_rank sample (rank 5 computes ~1.7x slower than its stage peers) reach each tracker
and read back through the tracker's own reader, offline and on local files: TensorBoard's event
files, an MLflow file store, an offline W&B run (no network, no login)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from helpers import trackers as read
from helpers.cli import assert_one_line_error, megascope
from helpers.paths import ROOT

SAMPLE = os.path.join(ROOT, "samples", "slow_rank")
SLOW = 5
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
             "WANDB_DISABLE_CODE": "true", "WANDB_API_KEY": ""}  # fmt: skip


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """The sample run (a copy), its report (no what-if) and its per-step scores."""
    from analyzer.db import open_run
    from analyzer.findings import analyze
    from analyzer.rank_steps import build_rank_step_tables, step_scores

    run_dir = str(tmp_path_factory.mktemp("trackers") / "slow_rank")
    shutil.copytree(SAMPLE, run_dir)
    run = open_run(run_dir)
    try:
        report = analyze(run, whatif=False)
        build_rank_step_tables(run)
        scores = step_scores(run, tuple(report["run"]["steps"]))
    finally:
        run.close()
    return run_dir, report, scores


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    for k, v in WANDB_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def _feed(kind: str, sample, tmp_path, run: str | None = None):
    """Log the sample's report and scores to ``kind`` as ``analyze --log-to`` does."""
    from analyzer.db import open_run
    from analyzer.trackers import TrackerFeed, make_tracker
    from analyzer.trackers.base import TrackerTarget

    run_dir, report, _ = sample
    feed = TrackerFeed(make_tracker(TrackerTarget(kind, run, str(tmp_path / kind), "sample")))
    db = open_run(run_dir)
    try:
        feed.report(db, report["findings"], tuple(report["run"]["steps"]))
        feed.report(db, report["findings"], tuple(report["run"]["steps"]))  # nothing new: no-op
    finally:
        db.close()
        feed.close()
    return feed.tracker


def test_the_scores_are_the_heatmaps_own_time_over_peers_and_name_the_slow_rank(sample):
    _, report, scores = sample
    lo, hi = report["run"]["steps"]
    assert [s.step for s in scores] == list(range(lo, hi + 1))
    worst = [max(s.scores, key=s.scores.__getitem__) for s in scores]
    assert worst.count(SLOW) >= 0.8 * len(worst)
    assert all(len(s.scores) == 8 and s.exposed_comm_ms and s.exposed_comm_ms > 0 for s in scores)
    assert any(f["kind"] == "straggler" and f["ranks"] == [SLOW] for f in report["findings"])


def test_tensorboard_event_files_hold_the_findings_and_scores(sample, tmp_path):
    _, report, scores = sample
    _feed("tensorboard", sample, tmp_path)
    (log_dir,) = (tmp_path / "tensorboard").iterdir()
    assert log_dir.name == "megascope-sample"
    acc = read.tensorboard(log_dir)
    got = {e.step: e.value for e in acc.Scalars(f"megascope/straggler_score/rank_{SLOW}")}
    assert got == pytest.approx({s.step: s.scores[SLOW] for s in scores})
    exposed = {e.step: e.value for e in acc.Scalars("megascope/exposed_comm_ms")}
    assert exposed == pytest.approx({s.step: s.exposed_comm_ms for s in scores})
    sev = acc.Scalars(f"megascope/finding/straggler/ranks_{SLOW}/severity")
    straggler = next(f for f in report["findings"] if f["kind"] == "straggler")
    assert [(e.step, round(e.value, 4)) for e in sev] == [
        (straggler["steps"][0], straggler["severity"])
    ]
    ((step, text),) = read.tensorboard_text(acc, "megascope/findings")
    logged = json.loads(text)
    assert step == report["run"]["steps"][1] and len(logged) == len(report["findings"])
    assert any(f["kind"] == "straggler" and f["ranks"] == [SLOW] and f["onset_step"] is not None
               for f in logged)  # fmt: skip


def test_mlflow_file_store_holds_them_in_a_new_run_and_in_the_users_own(sample, tmp_path):
    _, report, scores = sample
    tracker = _feed("mlflow", sample, tmp_path)
    client = read.mlflow_client(tmp_path / "mlflow")
    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "megascope-sample" and run.info.status == "FINISHED"
    hist = client.get_metric_history(tracker.run_id, f"straggler_score/rank_{SLOW}")
    assert {m.step: m.value for m in hist} == pytest.approx(
        {s.step: s.scores[SLOW] for s in scores}
    )
    assert len(client.get_metric_history(tracker.run_id, "exposed_comm_ms")) == len(scores)
    sev = client.get_metric_history(tracker.run_id, f"finding/straggler/ranks_{SLOW}/severity")
    assert len(sev) == 1 and sev[0].value > 0
    logged = json.loads(
        read.mlflow_text(client, tracker.run_id, "megascope/findings.json", tmp_path)
    )
    assert [f["kind"] for f in logged] == [f["kind"] for f in report["findings"]]
    assert run.data.tags["megascope.findings"] == str(len(report["findings"]))

    # the user's own run: logged into, and left running (megascope did not begin it)
    exp = client.create_experiment("users-training")
    mine = client.create_run(exp).info.run_id
    _feed("mlflow", sample, tmp_path, run=mine)
    assert len(client.get_metric_history(mine, f"straggler_score/rank_{SLOW}")) == len(scores)
    assert client.get_run(mine).info.status == "RUNNING"


def test_wandb_offline_run_holds_them(sample, tmp_path, wandb_env):
    _, report, scores = sample
    tracker = _feed("wandb", sample, tmp_path, run="users-project/abc123")
    assert tracker.run.id == "abc123" and tracker.run.project == "users-project"
    path = read.run_file(tmp_path / "wandb")
    rows = read.history(path)
    got = {r["megascope/step"]: r[f"megascope/straggler_score/rank_{SLOW}"]
           for r in rows if f"megascope/straggler_score/rank_{SLOW}" in r}  # fmt: skip
    assert got == pytest.approx({s.step: s.scores[SLOW] for s in scores})
    sev = [r for r in rows if f"megascope/finding/straggler/ranks_{SLOW}/severity" in r]
    assert len(sev) == 1
    summary = read.summary(path)["megascope/findings"]
    assert [f["kind"] for f in summary] == [f["kind"] for f in report["findings"]]
    assert any(f["kind"] == "straggler" and f["ranks"] == [SLOW] for f in summary)


def test_a_missing_client_library_names_the_extra(sample, tmp_path, monkeypatch):
    run_dir, _, _ = sample
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    proc = megascope("analyze", run_dir, "--no-whatif", "--log-to", "mlflow",
                     "--tracker-dir", str(tmp_path / "m"))  # fmt: skip
    assert_one_line_error(proc, "megascope[mlflow]")
    proc = megascope("analyze", run_dir, "--tracker-run", "x")
    assert_one_line_error(proc, "--log-to")


def _mean_scores(rows: dict[int, dict[int, float]]) -> dict[int, float]:
    """{rank: mean score} from {rank: {step: score}}."""
    return {r: sum(v.values()) / len(v) for r, v in rows.items() if v}


@pytest.mark.live
@pytest.mark.solo
def test_the_demo_reaches_all_three_trackers_with_its_named_rank(demo, tmp_path, monkeypatch):
    """The demo's run (8 ranks, rank 5 2x slower): ``analyze --log-to tensorboard`` and
    ``mlflow``, ``watch --once --log-to wandb``; each tracker's reader finds the straggler
    finding of the named rank and that rank's score the highest."""
    assert demo.returncode == 0, demo.stderr[-2000:]
    with open(os.path.join(demo.run, "findings.json")) as f:
        named = next(x["ranks"] for x in json.load(f)["findings"] if x["kind"] == "straggler")
    (rank,) = named
    for k, v in WANDB_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    ranks = range(8)

    tb = tmp_path / "tb"
    megascope("analyze", demo.run, "--no-whatif", "--log-to", "tensorboard",
              "--tracker-run", str(tb), check=True)  # fmt: skip
    acc = read.tensorboard(tb)
    means = _mean_scores({r: {e.step: e.value for e in acc.Scalars(
        f"megascope/straggler_score/rank_{r}")} for r in ranks})  # fmt: skip
    assert max(means, key=means.__getitem__) == rank, means
    assert acc.Scalars(f"megascope/finding/straggler/ranks_{rank}/severity")

    store = tmp_path / "mlruns"
    proc = megascope("analyze", demo.run, "--no-whatif", "--log-to", "mlflow",
                     "--tracker-dir", str(store), check=True)  # fmt: skip
    assert "logged to MLflow run" in proc.stderr
    client = read.mlflow_client(store)
    (run,) = client.search_runs([client.get_experiment_by_name("megascope").experiment_id])
    means = _mean_scores({r: {m.step: m.value for m in client.get_metric_history(
        run.info.run_id, f"straggler_score/rank_{r}")} for r in ranks})  # fmt: skip
    assert max(means, key=means.__getitem__) == rank, means
    assert client.get_metric_history(run.info.run_id, f"finding/straggler/ranks_{rank}/severity")

    wdir = tmp_path / "wandb"
    proc = megascope("watch", demo.run, "--once", "--no-whatif", "--log-to", "wandb",
                     "--tracker-dir", str(wdir))  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-2000:]  # a finding active: the straggler
    rows = read.history(read.run_file(wdir))
    means = _mean_scores({r: {x["megascope/step"]: x[f"megascope/straggler_score/rank_{r}"]
        for x in rows if f"megascope/straggler_score/rank_{r}" in x} for r in ranks})  # fmt: skip
    assert max(means, key=means.__getitem__) == rank, means
    summary = read.summary(read.run_file(wdir))["megascope/findings"]
    assert any(f["kind"] == "straggler" and f["ranks"] == [rank] for f in summary), summary


class Recording:
    """A tracker that keeps what it was sent (the feed's logic, without a client library)."""

    where = "a list"

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.findings: list[tuple[int, list[str], list[str]]] = []
        self.closed = False

    def log_steps(self, rows):
        self.steps.append([r.step for r in rows])

    def log_findings(self, findings, step, new):
        self.findings.append((step, [f.key for f in findings], [f.key for f in new]))

    def close(self):
        self.closed = True


def test_a_watchs_feed_logs_each_step_once_and_findings_when_they_change(sample):
    from analyzer.trackers import TrackerFeed

    run_dir, report, _ = sample
    rec = Recording()
    feed = TrackerFeed(rec)
    straggler = next(f for f in report["findings"] if f["kind"] == "straggler")
    feed.look(run_dir, [], (2, 10))
    feed.look(run_dir, [straggler], (4, 13))  # a window sliding on: steps 11-13 are new
    feed.look(run_dir, [straggler], (4, 13))  # nothing new
    feed.look(run_dir, [], (5, 14))  # cleared
    feed.look(run_dir, [straggler], (6, 15))  # back: its severity was logged already
    key = f"straggler/ranks_{SLOW}"
    assert rec.steps == [list(range(2, 11)), [11, 12, 13], [14], [15]]
    assert rec.findings == [(10, [], []), (13, [key], [key]), (14, [], []), (15, [key], [])]
    feed.close()
    assert rec.closed
