"""The dashboard's data side on real run directories: DuckDB queries, live refresh, the run
picker's guard, and the command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.cli import megascope
from helpers.dash import array, callback
from helpers.small_run import write_small_run

from dashboard import serving, views
from dashboard.cli import is_loopback
from dashboard.runs import RunPathError, RunRegistry
from dashboard.source import RunSource

MESH = {"dp": 2, "pp": 2, "tp": 2}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    return write_small_run(
        str(tmp_path_factory.mktemp("runs") / "slow5"), MESH, steps=6, slow_rank=5, factor=1.5
    )


@pytest.fixture(scope="module")
def src(run_dir) -> RunSource:
    return RunSource(run_dir)


def test_compute_time_lands_on_the_slow_rank(src):
    values = views.rank_values(src, "compute", 0, 5).set_index("rank")
    # forward 10 ms + backward 20 ms + optimizer 2 ms, the slow rank's forward and backward x1.5
    assert values.loc[5, "value"] == pytest.approx(47.0)
    assert values.drop(index=5)["value"].tolist() == pytest.approx([32.0] * 7)
    assert (values.loc[5, "dp"], values.loc[5, "pp"], values.loc[5, "tp"]) == (0, 1, 1)
    assert values.loc[5, "host"] == "node1"


def test_gpu_metrics_and_the_step_range(src):
    clocks = views.rank_values(src, "sm_clock", 2, 4).set_index("rank")["value"]
    assert clocks[5] == 1200 and (clocks.drop(index=5) == 1980).all()
    assert views.step_bounds(src) == (0, 5)


def test_waiting_is_highest_where_peers_wait_for_the_slow_rank(src):
    comm = views.rank_values(src, "comm", 0, 5).set_index("rank")["value"]
    # rank 5's tensor peer (4) waits in the tp all-reduce; stage 0 ranks hardly wait
    assert comm[4] > comm[5] > comm[0]


def test_rank_step_grid_is_bounded_and_names_the_worst_rank(src):
    grid = views.rank_step_grid(src, 0, 5, rank_bins=3, step_bins=2)
    assert grid["rbin"].nunique() == 3 and grid["sbin"].nunique() == 2 and len(grid) == 6
    hot = grid[grid["compute_ms"] == grid["compute_ms"].max()]
    assert set(hot["worst_rank"]) == {5}
    assert (hot["rank_lo"] <= 5).all() and (hot["rank_hi"] >= 5).all()
    full = views.rank_step_grid(src, 0, 5)
    assert len(full) == 8 * 6  # small runs are not binned


def test_rank_step_grid_puts_each_rank_against_its_stage_peers(src):
    grid = views.rank_step_grid(src, 0, 5)
    ratio = grid.pivot(index="rank_lo", columns="step_lo", values="peer_ratio")
    # rank 5's forward and backward x1.5: the median of its spans' ratios to its stage
    # peers' (forward 1.5, backward 1.5, optimizer 1.0); its tensor peer 4 waits for it in
    # the tp all-reduce, which is not own time
    assert (ratio.idxmax() == 5).all()
    assert ratio.loc[5].to_numpy() == pytest.approx([1.5] * 6)
    assert ratio.drop(index=5).to_numpy() == pytest.approx(np.ones((7, 6)))
    own = grid.pivot(index="rank_lo", columns="step_lo", values="own_ms")
    step = grid.pivot(index="rank_lo", columns="step_lo", values="step_ms")
    comm = grid.pivot(index="rank_lo", columns="step_lo", values="comm_ms")
    assert own.to_numpy() == pytest.approx((step - comm).clip(lower=0).to_numpy())
    assert set(grid["worst_rank"]) == set(range(8))  # one rank per row: itself


def test_timeline_and_links_queries(src):
    ranks = views.neighbourhood(src, 5)
    assert ranks == [1, 4, 5]  # pipeline peer (stage 0) and tensor peer
    spans, colls = views.timeline_rows(src, ranks, 2)
    assert set(spans["rank"]) == {1, 4, 5} and "step" not in set(spans["name"])
    assert {"send", "recv", "all_reduce"} <= set(colls["op"])
    p2p, groups = views.links(src, 0, 5)
    assert sorted(zip(p2p["src"], p2p["dst"], strict=True)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert set(groups["group_name"]) == {"dp", "tp"} and len(groups) == 8


def test_unknown_metric_is_refused_before_any_sql(src):
    with pytest.raises(ValueError, match="unknown metric"):
        views.rank_values(src, "compute'; drop table spans; --", 0, 5)
    with pytest.raises(ValueError):
        views.metric(["compute"])


def test_live_refresh_rebuilds_only_when_a_rank_writes(tmp_path):
    run = write_small_run(str(tmp_path / "live"), MESH, steps=3, status="running")
    live = RunSource(run)
    first = live.refresh()
    assert live.live and views.step_bounds(live) == (0, 2)
    assert live.refresh() == first and live.builds == 1  # nothing new: nothing re-built
    time.sleep(0.01)
    write_small_run(run, MESH, steps=2, status="running", first_step=3)
    assert live.refresh() != first and live.builds == 2
    assert views.step_bounds(live) == (0, 4)


def test_run_picker_stays_inside_the_served_folder(tmp_path, run_dir):
    root = tmp_path / "root"
    root.mkdir()
    write_small_run(str(root / "a"), MESH, steps=2)
    write_small_run(str(root / "b"), MESH, steps=2)
    (root / "notes").mkdir()
    os.symlink(run_dir, root / "escape")  # a run outside, linked in
    reg = RunRegistry(str(root))
    assert not reg.single and reg.names() == ["a", "b"]
    assert reg.get("a").meta["run_id"] == "a"
    for bad in ("../root/a", "/etc", "notes", "escape", "", None, ["a"], "a/../../x"):
        with pytest.raises(RunPathError):
            reg.get(bad)
    single = RunRegistry(run_dir)
    assert single.single and single.names() == ["."]
    with pytest.raises(RunPathError, match="no such directory"):
        RunRegistry(str(tmp_path / "missing"))
    with pytest.raises(RunPathError, match="neither a run"):
        RunRegistry(str(root / "notes"))


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    for args, needle in [
        ((str(tmp_path / "nope"),), "no such directory"),
        ((str(tmp_path),), "neither a run directory"),
        ((str(tmp_path), "--port", "70000"), "--port 70000"),
        (("--port", "x", str(tmp_path)), "invalid int value"),
    ]:
        got = megascope("dashboard", *args)
        assert got.returncode == 2, got.stderr
        assert needle in got.stderr and len(got.stderr.strip().splitlines()) == 1
        assert "Traceback" not in got.stderr


def test_cli_warns_once_when_bound_beyond_loopback(run_dir):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "analyzer",
            "dashboard",
            run_dir,
            "--host",
            "0.0.0.0",
            "--port",
            str(serving.free_port()),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert line.startswith("megascope: warning: serving on 0.0.0.0")


def test_callbacks_refuse_runs_outside_the_folder_and_unknown_metrics(tmp_path):
    from dashboard.app import create_app

    root = tmp_path / "root"
    write_small_run(str(root / "a"), MESH, steps=3, slow_rank=5)
    client = create_app(str(root)).server.test_client()
    poll = "..version.data...poll.disabled...run-info.children.."
    got = callback(
        client,
        poll,
        [("poll", "n_intervals", 0), ("run", "value", "a")],
        [("version", "data", None)],
    )
    version = got["version"]["data"]
    assert version["run"] == "a" and "8 ranks" in got["run-info"]["children"]
    bad = callback(
        client,
        poll,
        [("poll", "n_intervals", 1), ("run", "value", "../a")],
        [("version", "data", None)],
    )
    assert "unknown run" in bad["run-info"]["children"] and "version" not in bad
    topo = "..topology.figure...slab.figure...slab-box.style.."
    inputs = [
        ("version", "data", version),
        ("metric", "value", "compute"),
        ("steps", "value", [0, 2]),
        ("slice-axis", "value", "pp"),
        ("slice-index", "value", 1),
        ("cp", "value", -1),
        ("selected", "data", [5]),
        ("work", "value", "time"),
    ]
    fig = callback(client, topo, inputs)
    cells = fig["topology"]["figure"]["data"][0]
    assert sorted(int(c) for c in cells["customdata"]) == [4, 5, 6, 7]  # the pp=1 slab
    assert fig["slab-box"]["style"] == {"display": "block"}
    evil = [inputs[0], ("metric", "value", "compute from spans; --"), *inputs[2:]]
    fig = callback(client, topo, evil)
    assert "unknown metric" in fig["topology"]["figure"]["layout"]["annotations"][0]["text"]


def test_heatmap_is_relative_to_the_peers_by_default_and_offers_the_other_measures(tmp_path):
    from dashboard.app import create_app

    root = tmp_path / "root"
    write_small_run(str(root / "a"), MESH, steps=4, slow_rank=5)
    client = create_app(str(root)).server.test_client()
    layout = client.get("/_dash-layout").get_json()
    assert '"id": "heatmap-measure"' in str(layout).replace("'", '"')
    assert '"value": "peers"' in str(layout).replace("'", '"')
    poll = "..version.data...poll.disabled...run-info.children.."
    version = callback(
        client, poll, [("poll", "n_intervals", 0), ("run", "value", "a")],
        [("version", "data", None)],
    )["version"]["data"]  # fmt: skip

    def heat(measure):
        inputs = [("tabs", "value", "heatmap"), ("version", "data", version),
                  ("heatmap-measure", "value", measure), ("steps", "value", [0, 3]),
                  ("selected", "data", [])]  # fmt: skip
        return callback(client, "heatmap.figure", inputs)["heatmap"]["figure"]

    fig = heat(views.HEATMAP_DEFAULT)
    z = array(fig["data"][0]["z"])
    assert z.shape == (8, 4) and (z.argmax(axis=0) == 5).all()  # rows are ranks 0-7
    assert fig["data"][0]["zmin"] == 1.0 and "peers" in fig["layout"]["title"]["text"]
    for key, m in views.HEATMAP_MEASURES.items():
        fig = heat(key)
        assert f"({m.unit})" in fig["layout"]["title"]["text"], key
    blame = array(heat("blame")["data"][0]["z"])
    assert blame[5].min() > 0 and blame[[0, 1, 2, 3]].max() == 0  # the straggler's row
    bad = heat("compute_ms; drop table spans")
    assert "unknown heatmap measure" in bad["layout"]["annotations"][0]["text"]


def test_a_large_run_reads_the_digest_cache_and_timelines_from_rank_folders(run_dir, monkeypatch):
    import dashboard.source as source

    ranks = [4, 5]
    exact = RunSource(run_dir)
    a = views.rank_values(exact, "compute", 0, 5).set_index("rank")["value"]
    whole = views.timeline_rows(exact, ranks, 3)
    assert not exact._run._restricted  # noqa: SLF001 (a small run: the whole run's views)
    monkeypatch.setattr(source, "DRAW_EXACT_MAX_RANKS", 4)  # 8 ranks count as large here
    large = RunSource(run_dir)
    b = views.rank_values(large, "compute", 0, 5).set_index("rank")["value"]
    assert b.idxmax() == 5 and b[5] == pytest.approx(a[5])  # no nested spans: sums = unions
    # no per-span comparison past DRAW_EXACT_MAX_RANKS: own time (step - collectives) per step
    # over the stage peers' median (48 ms against 32-33 ms)
    ratio = views.rank_step_grid(large, 0, 5).pivot(
        index="rank_lo", columns="step_lo", values="peer_ratio"
    )
    assert (ratio.idxmax() == 5).all() and ratio.loc[5, 2] == pytest.approx(48 / 33)
    part = views.timeline_rows(large, ranks, 3)
    assert large._run._restricted  # noqa: SLF001 (read from those ranks' folders only)
    for x, y in zip(whole, part, strict=True):
        assert len(x) > 0 and x.reset_index(drop=True).equals(y.reset_index(drop=True))


def test_whatif_finds_the_slow_worker_and_is_cached(src, monkeypatch):
    import analyzer.whatif

    got = views.whatif(src, *views.step_bounds(src))
    grid = got["grid"].set_index(["dp", "pp"])
    # rank 5 (dp0 pp1, with its tensor peer 4) computes 1.5x slower: its cell alone is slow
    assert grid.loc[(0, 1), "first_rank"] == 4 and grid.loc[(0, 1), "ranks"] == 2
    assert grid.loc[(0, 1), "slowdown"] == pytest.approx(1.2652, abs=1e-3)
    assert grid.drop(index=(0, 1))["slowdown"].tolist() == pytest.approx([1.0, 1.0, 1.0])
    steps = got["steps"]
    assert steps["step"].tolist() == [0, 1, 2, 3, 4, 5]
    # measured 62 ms a step (forward 15 + backward 30 on rank 5 ...), ideal 49.5 ms
    assert steps["slowdown"].tolist() == pytest.approx([62 / 49.5] * 6, rel=1e-4)
    assert got["summary"]["cells_replayed"] == 4
    part = views.whatif(src, 1, 3)
    assert part["steps"]["step"].tolist() == [1, 2, 3]
    monkeypatch.setattr(analyzer.whatif, "prepare", lambda *a, **k: pytest.fail("prepared again"))
    assert views.whatif(src, *views.step_bounds(src)) is got  # cached per data version
    assert views.whatif(src, 1, 3) is part
    assert src.prepared_whatif((1, 3)) is src.prepared_whatif((1, 3))


def test_whatif_panel_shows_the_grid_or_one_line(tmp_path):
    from dashboard.app import create_app

    root = tmp_path / "root"
    write_small_run(str(root / "a"), MESH, steps=4, slow_rank=5)
    write_small_run(str(root / "empty"), MESH, steps=0)
    client = create_app(str(root)).server.test_client()
    poll = "..version.data...poll.disabled...run-info.children.."
    panel = "..whatif.figure...whatif-info.children.."
    for name, last in (("a", 3), ("empty", 0)):
        version = callback(
            client, poll, [("poll", "n_intervals", 0), ("run", "value", name)],
            [("version", "data", None)],
        )["version"]["data"]  # fmt: skip
        inputs = [("tabs", "value", "whatif"), ("version", "data", version),
                  ("steps", "value", [0, last])]  # fmt: skip
        got = callback(client, panel, inputs)
        figure, info = got["whatif"]["figure"], got["whatif-info"]["children"]
        if name == "a":
            heat = figure["data"][0]
            assert heat["type"] == "heatmap" and heat["customdata"][1][0] == "4"
            assert array(heat["z"])[1, 0] == pytest.approx(1.2652, abs=1e-3)  # dp0 stage 1
            assert array(figure["data"][1]["y"]).tolist() == pytest.approx([1.2525] * 4, abs=1e-4)
            assert info.startswith("4 steps replayed")
        else:  # no step to replay: one line in the panel, no traceback
            line = info["props"]["children"]
            assert line.startswith("no what-if for this run:") and "\n" not in line
            assert "Traceback" not in line
            assert figure["layout"]["annotations"][0]["text"] == line
