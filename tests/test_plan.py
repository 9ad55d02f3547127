"""``megascope plan``: every layout of a simulated run's ranks, predicted and ranked; the run's
own layout predicted as measured (the model's self-check); memory that does not fit; the JSON;
bad input. Live: a short trainer run planned, its memory against the trainer's accounting."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers.cli import assert_one_line_error, megascope
from helpers.dash import callback

from analyzer.plan import PlanError, plan_run
from analyzer.plan.memory import parse_bytes, rank_memory
from analyzer.plan.shape import shape_of
from analyzer.synth import SynthConfig, synthesize

MESHES = {(dp, tp, pp, cp) for dp in (1, 2, 4) for tp in (1, 2, 4) for pp in (1, 2, 4)
          for cp in (1, 2, 4) if dp * tp * pp * cp == 4}  # fmt: skip


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("plan") / "run")
    synthesize(SynthConfig(mesh={"dp": 2, "pp": 2, "tp": 1, "cp": 1}, steps=8, microbatches=4), out)
    return out


@pytest.fixture(scope="module")
def plan(synth_run) -> dict:
    p = megascope("plan", synth_run, "--json", check=True)
    return json.loads(p.stdout)


def test_every_layout_of_the_ranks(plan):
    got = {(x["dp"], x["tp"], x["pp"], x["cp"]) for x in plan["layouts"]}
    refused = {(x["dp"], x["tp"], x["pp"], x["cp"]) for x in plan["refused"]}
    assert got | refused == MESHES and not got & refused
    for x in plan["layouts"]:
        # the run's global batch of 8 microbatches, whatever the layout
        assert x["dp"] * x["microbatches"] == 8
    variants = {(x["recompute"], x["sharded_optimizer"]) for x in plan["layouts"] if x["dp"] > 1}
    assert variants == {("none", True), ("none", False), ("full", True), ("full", False)}


def test_the_run_layout_predicts_its_own_step(plan):
    own = [x for x in plan["layouts"] if x["run_layout"]]
    assert len(own) == 1
    assert (own[0]["dp"], own[0]["tp"], own[0]["pp"], own[0]["cp"]) == (2, 1, 2, 1)
    assert own[0]["recompute"] == "none" and own[0]["sharded_optimizer"]
    check = plan["self_check"]
    assert check["predicted_step_ms"] == own[0]["predicted_step_ms"]
    assert abs(check["error"]) < 0.05, check


def test_ranked_and_explained(plan):
    rows = plan["layouts"]
    assert [x["rank"] for x in rows] == list(range(1, len(rows) + 1))
    times = [x["predicted_step_ms"] for x in rows]
    assert times == sorted(times)  # everything fits 80 GiB here
    assert all(x["fits"] for x in rows)
    for x in rows:
        assert x["dominant"] in ("compute", "exposed communication", "pipeline bubble")
        assert x["mfu"] is not None and 0 < x["mfu"] < 1
        parts = x["compute_ms"] + x["exposed_comm_ms"] + x["bubble_ms"]
        assert parts == pytest.approx(x["predicted_step_ms"], rel=1e-3)
        assert x["memory_per_rank_bytes"] == x["memory"]["total_bytes"]
    # a pipeline has a bubble, one stage has none; recompute costs time and saves memory
    by = {(x["dp"], x["tp"], x["pp"], x["cp"], x["recompute"], x["sharded_optimizer"]): x
          for x in rows}  # fmt: skip
    assert by[(1, 1, 4, 1, "none", True)]["bubble_ms"] > 0
    assert by[(4, 1, 1, 1, "none", True)]["bubble_ms"] == 0
    plain, full = by[(4, 1, 1, 1, "none", True)], by[(4, 1, 1, 1, "full", True)]
    assert full["predicted_step_ms"] > plain["predicted_step_ms"]
    assert full["memory"]["activations_bytes"] < plain["memory"]["activations_bytes"]
    unsharded = by[(4, 1, 1, 1, "none", False)]
    assert unsharded["memory"]["optimizer_bytes"] > plain["memory"]["optimizer_bytes"]
    assert plan["cannot_predict"] and any("number of ranks" in s for s in plan["cannot_predict"])


def test_small_device_memory_is_listed(synth_run):
    p = megascope("plan", synth_run, "--device-memory", "12GiB", "--json", check=True)
    r = json.loads(p.stdout)
    assert r["run"]["device_memory_bytes"] == 12 * 2**30
    fits = [x for x in r["layouts"] if x["fits"]]
    over = [x for x in r["layouts"] if x["fits"] is False]
    assert fits and over
    assert all(x["memory_per_rank_bytes"] > 12 * 2**30 for x in over)
    assert all(x["memory_per_rank_bytes"] <= 12 * 2**30 for x in fits)
    # the ones that fit come first, then the others, each by predicted time
    assert r["layouts"][: len(fits)] == fits
    text = megascope("plan", synth_run, "--device-memory", "12GiB", check=True).stdout
    assert "NO" in text and "<- the run's layout" in text and "cannot predict" in text


def test_memory_follows_the_sharding(synth_run):
    from analyzer.db import open_run

    run = open_run(synth_run)
    shape = shape_of(run.meta)
    run.con.close()
    one = rank_memory(shape, 1, 1, 4, 1, "none", True)
    four = rank_memory(shape, 4, 1, 1, 1, "none", True)
    p = shape.rank_params(1, 1, 0)
    assert four["params_bytes"] == pytest.approx(2 * p)  # simulated: bf16 parameters
    assert four["optimizer_bytes"] == pytest.approx(16 * p / 4)  # masters, moments, grad slice
    assert one["params_bytes"] == pytest.approx(2 * shape.rank_params(4, 1, 0))


def test_bad_input(tmp_path, synth_run):
    assert_one_line_error(megascope("plan", str(tmp_path / "nothing")), "megascope: error")
    assert_one_line_error(megascope("plan", synth_run, "--device-memory", "lots"),
                          "--device-memory")  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "run.json").write_text(json.dumps({"schema_version": 1, "world_size": 4}))
    assert_one_line_error(megascope("plan", str(empty)), "megascope: error")
    with pytest.raises(PlanError):
        parse_bytes("12 parsecs")
    assert parse_bytes("512MiB") == 512 * 2**20


def test_live_trainer_run_memory_against_its_accounting(tmp_path, trained):
    out = trained(str(tmp_path / "run"), "--dp", "2", "--pp", "2", "--steps", "4",
                  "--microbatches", "2")  # fmt: skip
    with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert set(meta["memory"]) == {"0", "1", "2", "3"}
    r = plan_run(out)
    own = next(x for x in r["layouts"] if x["run_layout"])
    assert (own["dp"], own["tp"], own["pp"]) == (2, 1, 2)
    shape = shape_of(meta)
    for rank, acct in meta["memory"].items():
        stage = int(rank) // 2  # pp outermost: ranks 0, 1 are stage 0
        p = shape.rank_params(2, 1, stage)
        assert acct["params_bytes"] == pytest.approx(4 * p, rel=0.01)
        assert acct["grads_bytes"] == pytest.approx(4 * p, rel=0.01)
        assert acct["optimizer_bytes"] == pytest.approx(16 * p / 2, rel=0.01)
    peak = max(acct["params_bytes"] + acct["grads_bytes"] + acct["optimizer_bytes"]
               for acct in meta["memory"].values())  # fmt: skip
    m = own["memory"]
    assert m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] == pytest.approx(
        peak, rel=0.01
    )
    assert r["self_check"]["predicted_step_ms"] > 0


def test_dashboard_panel_shows_the_run_beside_the_table(plan):
    from dashboard.plan_view import plan_panel

    panel = plan_panel(plan)
    text = str(panel.to_plotly_json())
    assert "this run" in text and "dp2 × pp2" in text
    table = panel.children[0].children[1]
    rows = table.children[1].children
    assert len(rows) == len(plan["layouts"])
    own = [r for r in rows if r.className == "plan-own"]
    assert len(own) == 1 and own[0].children[0].style["fontWeight"] == "bold"


def test_dashboard_plan_tab(tmp_path, synth_run):
    from dashboard.app import create_app

    shutil.copytree(synth_run, tmp_path / "a")
    client = create_app(str(tmp_path)).server.test_client()
    poll = "..version.data...poll.disabled...run-info.children.."
    version = callback(
        client, poll, [("poll", "n_intervals", 0), ("run", "value", "a")],
        [("version", "data", None)],
    )["version"]["data"]  # fmt: skip
    got = callback(client, "plan-view.children",
                   [("tabs", "value", "plan"), ("version", "data", version)])  # fmt: skip
    text = str(got["plan-view"]["children"])
    assert "plan-table" in text and "this run" in text and "cannot predict" in text
