"""The regression detector (analyzer/findings/regression.py): a drift of the step time needs
enough steps and must stand well outside the run's own noise.

Healthy runs on a shared CPU wander: a 12-15 step run (10-13 steps after warm-up) compared
thirds of 3-4 steps, and 2 of 6 such runs here (and a 12-step FSDP2 run on an H200) were
reported as a +6-22% regression. The series below were measured on this project's CI-sized
machine (2 cores) from healthy runs; the trainer test runs the real trainer with a step time
that really grows (a slow_rank fault on every rank, a linear ramp).

A live healthy run is not asserted here: its step time follows its host, and a host that slows
through a run lifts it for real (a CI run on a busy machine read +23%, Kendall tau 0.54, over a
healthy 30-step dp2 x tp2 run; rightly a drift of what was measured). Whether healthy runs stay
clean is a rate over many runs, which bench/framework_accuracy.py measures (a regression is one
of its alarms); the series above are healthy runs that were measured, fixed here.
"""

from __future__ import annotations

import numpy as np
import pytest

from analyzer.db import open_run
from analyzer.findings import analyze
from analyzer.findings import regression as R

# per-step median step time (ms) over ranks, steps after warm-up, of healthy runs on 4 gloo
# ranks: megascope train --dp 2 --tp 2 (12, 15, 30 steps), examples/ddp.py (12, 15 steps),
# examples/fsdp2_tp.py --tp 2 (12, 15 steps)
HEALTHY = {
    "train 12": [575, 469, 430, 503, 591, 540, 593, 549, 513, 619],
    "train 15": [577, 378, 606, 518, 517, 472, 461, 422, 502, 522, 440, 440, 515],
    "train 30": [652, 823, 817, 749, 634, 618, 484, 667, 734, 719, 870, 711, 690, 659, 806,
                 510, 678, 752, 663, 654, 440, 572, 532, 622, 716, 789, 812, 527],
    "ddp 12": [92, 86, 109, 96, 93, 93, 100, 102, 101, 98],
    "ddp 15": [147, 175, 148, 125, 116, 125, 144, 122, 128, 141, 115, 138, 120],
    "fsdp2 12": [430, 485, 379, 276, 328, 301, 249, 289, 289, 310],
    "fsdp2 15": [305, 306, 353, 294, 278, 280, 264, 244, 386, 355, 363, 340, 352],
    "fsdp2 12 (+28%, tau 0.47)": [331, 290, 293, 276, 307, 362, 299, 321, 377, 376],
    "ddp 12 b": [148, 152, 142, 156, 146, 158, 154, 142, 168, 158],
    "ddp 12 c": [123, 125, 124, 149, 135, 120, 127, 132, 141, 122],
    "train 12 b": [398, 396, 357, 296, 383, 395, 340, 367, 416, 422],
}  # fmt: skip


def _old_rule(y: np.ndarray) -> bool:
    """The rule before: 9 steps, +10% from the first to the last third, Kendall tau >= 0.5."""
    k = len(y) // 3
    first, last = np.median(y[:k]), np.median(y[-k:])
    return len(y) >= 9 and last / first - 1 >= 0.10 and R._kendall_tau(y) >= 0.5  # noqa: SLF001


def _found(y) -> bool:
    y = np.asarray(y, dtype=float)
    return R.drift(np.arange(len(y)), y, 0.10) is not None


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_measured_healthy_runs_do_not_drift(name):
    assert not _found(HEALTHY[name])


def test_a_short_run_is_never_a_regression():
    # a clean +30% over 13 steps after warm-up (a 15-step run): too few steps to tell
    y = np.linspace(100.0, 130.0, 13)
    assert _old_rule(y) and not _found(y)
    assert _found(np.linspace(100.0, 130.0, R.MIN_STEPS))


def test_a_phase_of_slow_steps_is_noise_not_a_drift():
    """A shared machine's load comes and goes in phases of several steps (autocorrelated
    noise); one that is slow at the end of a short run is not a drift. Over 400 healthy
    series (lag-1 autocorrelation 0.8, 8% noise) the old rule fires in about 8%; the new one
    in under half as many, and never on a run shorter than MIN_STEPS."""
    rng = np.random.default_rng(0)
    old = new = 0
    for _ in range(400):
        n = int(rng.integers(10, 29))
        e, x = np.zeros(n), 0.0
        for i in range(n):
            x = 0.8 * x + rng.normal(0.0, 0.08)
            e[i] = x
        y = 500.0 * (1.0 + e)
        old += _old_rule(y)
        got = _found(y)
        new += got
        assert not (got and n < R.MIN_STEPS)
    assert old >= 20 and new <= old / 2, (old, new)


def test_a_steady_drift_is_found_through_the_noise():
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(200):
        y = 500.0 * np.linspace(1.0, 1.3, 28) * np.exp(rng.normal(0.0, 0.05, 28))
        hits += _found(y)
    assert hits >= 190, hits  # +30% over 28 steps through 5% noise: found in >= 95%
    y = np.linspace(100.0, 140.0, 18)
    d = R.drift(np.arange(18), y, 0.10)
    assert d is not None and d["slope"] == pytest.approx(40.0 / 17) and d["tau"] == 1.0


def test_a_level_shift_late_in_the_run_is_a_regression_from_its_step():
    """A +30% step change three quarters through 28 steps: a ramp's test reads its Kendall tau
    near 0.5 and its thirds barely apart; the change point dates it."""
    rng = np.random.default_rng(2)
    steps = np.arange(100, 128)
    ramps = shifts = 0
    for _ in range(200):
        y = 500.0 * np.where(steps >= 121, 1.3, 1.0) * np.exp(rng.normal(0.0, 0.05, 28))
        ramps += R._ramp(steps.astype(float), y, 0.10) is not None  # noqa: SLF001
        d = R.drift(steps, y, 0.10)
        shifts += d is not None and d["shape"] == "shift" and abs(d["at"] - 121) <= 1
    assert ramps <= 20 and shifts >= 180, (ramps, shifts)


def test_a_shift_needs_its_size_and_its_steps():
    y = np.where(np.arange(28) >= 14, 108.0, 100.0)  # +8%: under the drift worth reporting
    assert R.drift(np.arange(28), y, 0.10) is None
    y = np.where(np.arange(28) >= 26, 150.0, 100.0)  # two slow steps at the end: no level
    assert R.drift(np.arange(28), y, 0.10) is None


def _train(train, tmp_path, mesh: list[str], steps: int, *inject: str) -> dict:
    run = str(tmp_path / "run")
    specs = [a for spec in inject for a in ("--inject", spec)]
    res = train(*mesh, "--device", "cpu", "--steps", str(steps), *specs, "--out", run,
                timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    db = open_run(run)
    try:
        return analyze(db)
    finally:
        db.close()


def _kinds(report: dict) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in report["findings"]:
        out.setdefault(f["kind"], []).append(f["ranks"])
    return out


@pytest.mark.solo
def test_a_trainer_run_that_slows_down_is_a_regression(tmp_path, train):
    """Both ranks' compute grows by a fifth of its first level at every step from step 5 (a
    linear ramp, 6x by the end): the step time grows over the run on every rank alike, so no
    rank is a straggler. A ramp, not a compounding factor: a CI run of 1.15x every 3 steps
    (3.5x by the end, a curve of steps) read z 2.84 against the bar of 3 on its noise, where
    the same noise on this ramp reads about 10. Two ranks, one per core: on an oversubscribed
    host (dp2 x tp2 on 2 cores) the sleep a slow_rank adds frees a core for the peers it waits
    for, and the step time does not grow (measured: -3%)."""
    # the factor in force at step 5 + i is (1 + 0.2 (i + 1)): each step's own factor is the ratio
    ramp = [(5 + i, (1 + 0.2 * (i + 1)) / (1 + 0.2 * i)) for i in range(25)]
    faults = [f"slow_rank:rank={r},factor={f:.5f},step={s}" for r in range(2) for s, f in ramp]
    report = _train(train, tmp_path, ["--dp", "2"], 30, *faults)
    found = _kinds(report)
    # on a failure, what the run and the analysis read, so that it can be told apart
    seen = ([f["message"] for f in report["findings"]], report["notes"], report["dismissed"],
            report["run"])  # fmt: skip
    assert found.get("regression") == [[]], seen
    assert "straggler" not in found
    (f,) = [f for f in report["findings"] if f["kind"] == "regression"]
    ev = f["evidence"]
    assert ev["last_ms"] > ev["first_ms"] and ev["z"] >= R.Z


def test_what_a_rank_makes_the_others_of_its_stage_wait_is_its_excess_over_them():
    """With two ranks in a stage, the other waits the whole of the slower one's lead (the
    median of the two, their mean, would read half); a rank alone in its stage makes no one
    of it wait."""
    import pandas as pd

    from analyzer.findings.common import stage_excess

    rs = pd.DataFrame({
        "step": [0, 0, 0, 1, 1, 1],
        "pp": [0, 0, 1, 0, 0, 1],
        "work_ns": [300, 600, 500, 300, 300, 900],
    })  # fmt: skip
    assert stage_excess(rs, "work_ns").tolist() == [-300, 300, 0, 0, 0, 0]


def _cpu_run(name: str) -> str:
    import os

    from helpers.paths import DATA

    return os.path.join(DATA, "cpu_runs", name)


def test_a_drift_that_the_wait_for_a_core_explains_is_the_hosts_load_not_a_regression():
    """A healthy Lightning run whose host took on other work at step 7
    (tests/data/cpu_runs/lightning_healthy_host_busy): step time +25% from there, the ranks'
    CPU time a step flat, their wait for a core up by as much as the step. The job did not
    slow: no regression, and a note that says why the step time rose."""
    db = open_run(_cpu_run("lightning_healthy_host_busy"))
    try:
        report = analyze(db, whatif=False)
    finally:
        db.close()
    assert report["findings"] == []
    (note,) = report["notes"]
    assert (note["kind"], note["ranks"], note["evidence"]["from_step"]) == ("host_load", "all", 7)
    ev = note["evidence"]
    waited = ev["runq_last_ms"] - ev["runq_first_ms"]
    assert waited >= 0.8 * (ev["last_ms"] - ev["first_ms"])  # the rise is the wait
    assert abs(ev["cpu_last_ms"] - ev["cpu_first_ms"]) <= 0.05 * ev["cpu_first_ms"]


def test_a_straggler_that_began_in_the_window_explains_the_drift_its_peers_share():
    """Two ranks on 2 cores, rank 1 2x slow from step 20, a watch's looks taking a core beside
    them (tests/data/cpu_runs/dp2_slow1_from20_busy): over steps 15-34 the step time less what
    rank 0 waited for rank 1 still rises (the looks took rank 0's core too), but what it
    waited rose by most of the step's rise. One fault, one finding: the straggler."""
    db = open_run(_cpu_run("dp2_slow1_from20_busy"))
    try:
        report = analyze(db, steps=(15, 34), whatif=False)
    finally:
        db.close()
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("straggler", [1])]
    assert report["notes"] == []  # the looks took cores too, but the rank explains the drift


def test_a_level_shift_that_one_rank_leads_is_not_a_regression_before_it_is_named():
    """Rank 1 2x slow from step 20 on 2 ranks whose own times still swing before the fault
    (tests/data/cpu_runs/dp2_slow1_from20_late): the step time's shift at step 20 is rank 1's
    lead over rank 0 rising, not the whole run's: no look of a watch (20 steps) reads a
    regression, before the straggler is named (from step 22) or after."""
    db = open_run(_cpu_run("dp2_slow1_from20_late"))
    try:
        looks = {hi: analyze(db, steps=(max(hi - 19, 2), hi), whatif=False)["findings"]
                 for hi in range(19, 27)}  # fmt: skip
    finally:
        db.close()
    for hi, found in looks.items():
        assert "regression" not in [f["kind"] for f in found], (hi, found)
        assert [(f["kind"], f["ranks"]) for f in found] in ([], [("straggler", [1])]), found
    assert [(f["kind"], f["ranks"]) for f in looks[26]] == [("straggler", [1])]
