"""The what-if's tables for the dashboard (analyzer.whatif.views): the per-worker grid finds
the injected slow worker, a healthy run's workers are near 1.0, the study's ST trace has its
last stage highest, the bounded grid replays the cells with the most excess, and the per-step
slowdown agrees with `megascope whatif`."""

from __future__ import annotations

import os

import numpy as np
import pytest

from analyzer.importers.whatif import import_whatif
from analyzer.synth import SynthConfig, parse_injections, synthesize
from analyzer.whatif import analyze_whatif, prepare
from analyzer.whatif.views import per_step, summary, worker_grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ST = os.path.join(ROOT, "tests", "data", "whatif", "ST")
MESH = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}
SLOW = 5  # dp0 pp1 tp1


def _synth(path, *specs, steps: int = 6, mesh: dict | None = None) -> str:
    mesh = dict(mesh or MESH)
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]
    cfg = SynthConfig(mesh=mesh, steps=steps, microbatches=4,
                      faults=parse_injections(specs, world), seed=0, detail="coarse")  # fmt: skip
    synthesize(cfg, str(path), specs)
    return str(path)


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> str:
    return _synth(tmp_path_factory.mktemp("v") / "slow", f"slow_rank:rank={SLOW},factor=1.4")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> str:
    return _synth(tmp_path_factory.mktemp("v") / "healthy")


@pytest.fixture(scope="module")
def st(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("st") / "run")
    import_whatif(f"{ST}/trace-ST.parquet", f"{ST}/meta-ST.yaml", out)
    return out


def _cell(grid, dp: int, pp: int) -> float:
    return float(grid[(grid.dp == dp) & (grid.pp == pp)]["slowdown"].iloc[0])


def test_the_slow_workers_cell_is_the_top_cell(slow):
    w = prepare(slow)
    grid = worker_grid(w)
    assert sorted(zip(grid.dp, grid.pp, strict=True)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (grid["ranks"] == 2).all() and grid["replayed"].all()
    top = grid.loc[grid["slowdown"].idxmax()]
    assert (top.dp, top.pp, top.first_rank) == (0, 1, 4)  # ranks 4 and 5
    assert top.slowdown > 1.15
    others = grid[(grid.dp != 0) | (grid.pp != 1)]["slowdown"]
    assert (others < 1.05).all() and (others > 0.95).all()
    # the cell's S is the ideal replay with that cell's operations at measured durations
    ideal = w.ideal()
    keep = (w.coords["dp"] == 0) & (w.coords["pp"] == 1)
    assert top.slowdown == pytest.approx(np.mean(w.replay(keep=keep)) / np.mean(ideal))
    assert grid.loc[grid["excess_s"].idxmax(), "first_rank"] == 4


def test_a_healthy_runs_cells_are_near_one(healthy):
    grid = worker_grid(prepare(healthy))
    assert len(grid) == 4 and grid["replayed"].all()
    assert ((grid["slowdown"] > 0.98) & (grid["slowdown"] < 1.03)).all(), grid


def test_the_grid_is_bounded_to_the_cells_with_the_most_excess(slow):
    w = prepare(slow)
    full = worker_grid(w)
    part = worker_grid(w, max_cells=1)
    assert part["replayed"].sum() == 1 and part["slowdown"].isna().sum() == 3
    kept = part[part["replayed"]].iloc[0]
    assert (kept.dp, kept.pp) == (0, 1)
    assert kept.slowdown == pytest.approx(_cell(full, 0, 1))
    assert (part["excess_s"] == full["excess_s"]).all()
    assert worker_grid(w, max_cells=4)["replayed"].all()  # at the bound: every cell


def test_a_big_runs_grid_replays_fewer_cells(tmp_path):
    """Past the work budget (operations x steps per replay) only MIN_CELLS cells are
    replayed: the slow worker's among them."""
    from analyzer.whatif.views import MIN_CELLS, cell_budget

    mesh = {"dp": 4, "pp": 4, "tp": 1, "cp": 1}
    run = _synth(tmp_path / "r", "slow_rank:rank=14,factor=1.4", steps=3, mesh=mesh)  # dp2 pp3
    w = prepare(run)
    assert cell_budget(w) == 64 and cell_budget(w, max_work=1) == MIN_CELLS == 8
    grid = worker_grid(w, max_work=1)
    assert len(grid) == 16 and grid["replayed"].sum() == 8 and grid["slowdown"].isna().sum() == 8
    top = grid.loc[grid["slowdown"].idxmax()]
    assert (top.dp, top.pp) == (2, 3) and top.slowdown > 1.1
    assert grid["excess_s"][grid["replayed"]].min() >= grid["excess_s"][~grid["replayed"]].max()


def test_per_step_is_measured_over_ideal_and_agrees_with_whatif(slow, healthy):
    w = prepare(slow)
    steps = per_step(w)
    assert steps["step"].tolist() == [int(s) for s in w.steps] and len(steps) == 6
    assert np.allclose(steps["slowdown"], steps["measured_s"] / steps["ideal_s"])
    report = analyze_whatif(slow)
    for step, s in report["by_step"].items():
        assert s == pytest.approx(float(steps[steps.step == int(step)]["slowdown"].iloc[0]))
    assert (steps["slowdown"] > 1.15).all()  # the slow rank slows every step
    info = summary(w, steps, worker_grid(w))
    assert info["slowdown"] == pytest.approx(report["slowdown"])
    assert info["cells"] == info["cells_replayed"] == 4 and info["steps"] == 6
    calm = per_step(prepare(healthy))
    assert (calm["slowdown"] < 1.05).all()


def test_st_trace_has_its_last_stage_highest(st):
    w = prepare(st)
    grid = worker_grid(w)
    assert len(grid) == 8 and (grid["ranks"] == 1).all()
    last = grid[grid.pp == 3]["slowdown"]
    rest = grid[grid.pp < 3]["slowdown"]
    assert last.min() > rest.max() + 0.15
    assert ((last > 1.20) & (last < 1.25)).all(), last  # 1.227 and 1.233
    assert ((rest > 0.99) & (rest < 1.03)).all(), rest
    steps = per_step(w)
    assert len(steps) == 32
    worst = set(steps.nlargest(2, "slowdown")["step"])
    assert worst == {23, 25}  # the study's slowest steps
    assert np.mean(steps["measured_s"]) / np.mean(steps["ideal_s"]) == pytest.approx(
        1.1787, rel=0.01
    )
