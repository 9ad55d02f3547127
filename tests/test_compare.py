"""megascope compare RUN_A RUN_B: run against run, beyond the noise (docs/spec.md §4).

Synth runs of one mesh: two healthy ones of different seeds differ by nothing beyond the noise
(exit 0 under --fail-above); one with a slow rank against its healthy twin names the phases and
the rank that changed, the straggler that appeared, and exits 1 under --fail-above 1; the other
way round it is faster and the straggler disappeared; a larger batch (more microbatches a step)
changes every rank's forward and backward. Synth runs and the bootstrap are
deterministic, so these are exact answers. Live: a slowed training against a healthy twin.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import cli
from helpers.paths import ROOT

from analyzer.compare_noise import beyond, bootstrap

MESH = "dp=2,pp=2,tp=2"
SLOW = "slow_rank:rank=5,factor=1.5"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    made = {}
    for name, seed, fault in (("a", 1, []), ("b", 2, []), ("slow", 2, ["--inject", SLOW]),
                              ("batch", 2, ["--microbatches", "6"]),
                              ("dp4", 2, ["--mesh", "dp=4,pp=2,tp=2"])):  # fmt: skip
        made[name] = str(root / name)
        mesh = [] if "--mesh" in fault else ["--mesh", MESH]
        cli.megascope("synth", *mesh, "--steps", "14", "--seed", str(seed),
                      "--out", made[name], "--quiet", *fault, check=True)  # fmt: skip
    return made


def compare(*args: str) -> tuple[int, dict]:
    proc = cli.megascope("compare", *args, "--json")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


def test_healthy_twins_differ_by_nothing_beyond_noise(runs):
    rc, report = compare(runs["a"], runs["b"], "--fail-above", "1")
    assert rc == 0
    assert report["verdict"] == "no difference beyond noise"
    assert report["step"]["verdict"] == "within noise"
    assert {p["phase"]: p["verdict"] for p in report["phases"]} == dict.fromkeys(
        ("data", "forward", "backward", "optimizer", "exposed_comm"), "within noise"
    )
    assert {k["verdict"] for k in report["collectives"]} == {"within noise"}
    assert report["changed_ranks"] == [] and report["waiting_ranks"] == []
    assert report["fail_above"]["failed"] is False
    f = report["findings"]
    assert f["appeared"] == [] and f["disappeared"] == []
    text = cli.megascope("compare", runs["a"], runs["b"]).stdout
    assert "megascope compare: no difference beyond noise" in text


def test_slow_rank_against_its_healthy_twin_names_rank_and_phase(runs):
    rc, report = compare(runs["b"], runs["slow"], "--fail-above", "1")
    assert rc == 1 and report["fail_above"]["failed"] is True
    assert report["verdict"] == "slower"
    assert report["changed_ranks"] == [5]
    assert report["waiting_ranks"] == [0, 1, 2, 3, 4, 6, 7]
    phases = {p["phase"]: p["verdict"] for p in report["phases"]}
    assert phases["forward"] == phases["backward"] == phases["exposed_comm"] == "slower"
    assert phases["data"] == "within noise"
    rank5 = next(r for r in report["ranks"] if r["rank"] == 5)
    assert rank5["own"]["verdict"] == rank5["forward"]["verdict"] == "slower"
    assert rank5["backward"]["verdict"] == "slower"
    assert rank5["coords"] == {"dp": 0, "pp": 1, "tp": 1, "cp": 0, "host": "node0"}
    appeared = [(f["kind"], f["ranks"]) for f in report["findings"]["appeared"]]
    assert appeared == [("straggler", [5])] and report["findings"]["disappeared"] == []
    text = cli.megascope("compare", runs["b"], runs["slow"]).stdout
    assert "megascope compare: B is slower than A" in text
    assert "rank 5 (dp0 pp1 tp1, node0) changed: own work" in text
    assert "findings that appeared in B: straggler (ranks 5," in text


def test_a_larger_batch_changes_every_rank_forward_and_backward(runs):
    rc, report = compare(runs["b"], runs["batch"], "--fail-above", "1", "--no-whatif")
    assert rc == 1 and report["verdict"] == "slower"
    assert sorted(report["changed_ranks"]) == list(range(8)) and report["waiting_ranks"] == []
    phases = {p["phase"]: p["verdict"] for p in report["phases"]}
    assert phases["forward"] == phases["backward"] == "slower"
    assert phases["data"] == "within noise"
    assert {r["forward"]["verdict"] for r in report["ranks"]} == {"slower"}
    text = cli.megascope("compare", runs["b"], runs["batch"], "--no-whatif").stdout
    assert "8 of 8 ranks changed (ranks 0, 1, 2, 3, 4, 5, 6, 7): own work +" in text


def test_runs_of_different_layouts_say_so_and_keep_one_run_ranks_apart(runs):
    _, report = compare(runs["b"], runs["dp4"], "--no-whatif")
    alone = [r["rank"] for r in report["ranks"] if r["step"]["verdict"] == "only in B"]
    assert alone == list(range(8, 16))
    assert not set(alone) & set(report["changed_ranks"] + report["waiting_ranks"])
    assert report["notes"] == [
        "the runs' layouts differ (A: 8 ranks (dp=2 x pp=2 x tp=2), B: 16 ranks (dp=4 x pp=2 x "
        "tp=2)): ranks are compared by number, not by place in the mesh; 8 rank(s) are in one "
        "run only"
    ]


def test_the_other_way_round_is_faster_and_the_straggler_disappeared(runs):
    rc, report = compare(runs["slow"], runs["b"], "--fail-above", "1")
    assert rc == 0 and report["verdict"] == "faster" and report["changed_ranks"] == [5]
    gone = [(f["kind"], f["ranks"]) for f in report["findings"]["disappeared"]]
    assert gone == [("straggler", [5])] and report["findings"]["appeared"] == []


def test_fail_above_a_larger_share_than_the_slowdown_passes(runs):
    rc, report = compare(runs["b"], runs["slow"], "--fail-above", "50")
    fa = report["fail_above"]
    assert rc == 0 and {k: fa[k] for k in ("pct", "limit_ms", "failed")} == {"pct": 50.0,
        "limit_ms": pytest.approx(report["a"]["median_step_ms"] / 2, rel=0.02), "failed": False}  # fmt: skip
    assert "rank 5 slower in B than in A, mean step +" in fa["reason"]
    assert fa["reason"].endswith(": not above the limit (exit 0)")


def test_json_shape(runs):
    _, report = compare(runs["a"], runs["slow"], "--no-whatif")
    assert report["schema"] == "megascope.compare/1"
    assert set(report) == {"schema", "a", "b", "noise", "verdict", "step", "phases",
                           "collectives", "ranks", "findings", "changed_ranks",
                           "waiting_ranks", "notes", "per_step"}  # fmt: skip
    assert set(report["a"]) == {"path", "world_size", "mesh", "steps", "median_step_ms"}
    assert report["noise"]["resamples"] == 1000 and report["noise"]["level"] == 0.95
    assert set(report["step"]) == {"a_ms", "b_ms", "diff_ms", "low_ms", "high_ms",
                                   "change_pct", "verdict"}  # fmt: skip
    s = report["step"]
    assert s["low_ms"] <= s["diff_ms"] <= s["high_ms"]
    assert [p["phase"] for p in report["phases"]] == [
        "data", "forward", "backward", "optimizer", "exposed_comm"]  # fmt: skip
    assert {(k["group"], k["op"]) for k in report["collectives"]} == {
        ("dp", "all_gather"), ("dp", "reduce_scatter"), ("pp", "recv"),
        ("tp", "all_gather"), ("tp", "reduce_scatter")}  # fmt: skip
    assert [r["rank"] for r in report["ranks"]] == list(range(8))
    assert set(report["findings"]) == {"a", "b", "appeared", "disappeared", "kept"}
    assert [r["step"] for r in report["per_step"]["b"]] == list(range(2, 14))
    assert set(report["per_step"]["a"][0]) == {"step", "step_ms", "data_ms", "forward_ms",
                                               "backward_ms", "optimizer_ms", "exposed_comm_ms"}  # fmt: skip
    again = cli.megascope("compare", runs["a"], runs["slow"], "--no-whatif", "--json").stdout
    assert json.loads(again) == report  # deterministic: a fixed seed


def test_markdown_and_html_out(runs, tmp_path):
    md, page = tmp_path / "c.md", tmp_path / "c.html"
    for out in (md, page):
        proc = cli.megascope("compare", runs["b"], runs["slow"], "--no-whatif", "--out", str(out))
        assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    text = md.read_text()
    assert text.startswith("# megascope compare\n\nB is slower than A")
    assert "| rank 5 own work |" in text
    html = page.read_text()
    assert html.startswith("<!doctype html>") and "<td>rank 5 own work</td>" in html
    assert html.count("Plotly.newPlot") == 2 and "Where a step goes" in html


@pytest.mark.parametrize(
    "args",
    [["NOPE", "B"], ["A", "NOT_A_RUN"], ["A", "B", "--fail-above", "-3"], ["A"]],
    ids=["missing", "not-a-run", "negative-pct", "one-run"],
)
def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, args):
    (tmp_path / "NOT_A_RUN").mkdir()
    (tmp_path / "NOT_A_RUN" / "x.txt").write_text("x")
    names = {"A": runs["a"], "B": runs["b"], "NOPE": str(tmp_path / "nope"),
             "NOT_A_RUN": str(tmp_path / "NOT_A_RUN")}  # fmt: skip
    proc = cli.megascope("compare", *[names.get(a, a) for a in args])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "error" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bootstrap_is_deterministic_and_sees_a_shift():
    rng = np.random.default_rng(7)
    a = rng.normal(100.0, 1.0, size=(30, 2))
    b = a.copy()
    b[:, 1] += 5.0
    first, second = bootstrap(a, b), bootstrap(a, b)
    assert first == second
    same, shifted = first
    assert same.diff == 0 and same.low <= 0 <= same.high and not beyond(same, 1.0)
    assert shifted.diff == pytest.approx(5.0) and shifted.low > 0 and beyond(shifted, 1.0)
    assert not beyond(shifted, 10.0)  # under the floor: within the noise
    # a family of 20 quantities: each interval wider, so that all 20 hold together at 95%
    (alone,) = bootstrap(a[:, :1], b[:, :1])
    joint = bootstrap(np.repeat(a[:, :1], 20, axis=1), np.repeat(b[:, :1], 20, axis=1),
                      families=[20] * 20)  # fmt: skip
    assert joint[0].diff == alone.diff and joint[0].high - joint[0].low > alone.high - alone.low


@pytest.mark.solo
def test_live_slowed_training_against_its_healthy_twin(trained, tmp_path):
    common = ("--device", "cpu", "--dp", "2", "--steps", "10", "--seed", "1")
    healthy = trained(str(tmp_path / "healthy"), *common)
    slowed = trained(str(tmp_path / "slowed"), *common, "--inject", "slow_rank:rank=1,factor=3")
    rc, report = compare(healthy, slowed, "--fail-above", "1", "--no-whatif")
    assert rc == 1 and report["verdict"] == "slower"
    assert report["changed_ranks"][0] == 1  # the rank whose own work moved most comes first
    rank1 = next(r for r in report["ranks"] if r["rank"] == 1)
    assert rank1["own"]["verdict"] == "slower"
    assert ("straggler", [1]) in [(f["kind"], f["ranks"]) for f in report["findings"]["b"]]
    assert report["fail_above"]["work_change_pct"] is not None  # a CPU device counted its work


def test_a_run_without_spans_is_one_line_and_exit_2(runs, tmp_path):
    """A Flight Recorder import has collectives but no span to split a step into phases."""
    fr = str(tmp_path / "fr")
    src = os.path.join(ROOT, "tests", "data", "flight_recorder", "ep_gil")
    cli.megascope("import", "flight-recorder", src, "--out", fr, check=True)
    proc = cli.megascope("compare", runs["a"], fr)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"megascope: error: {fr}: no complete step with spans to compare\n"
