"""Dating a fault to the step: the level shift of a series (analyzer.changepoint), and the
windows timeline that uses it (analyze --windows)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from helpers.cli import megascope

from analyzer.changepoint import level_shift
from analyzer.windows import timeline


def noisy(levels: list[tuple[int, float]], sigma: float, seed: int) -> np.ndarray:
    """Steps at the given (count, level)s, with normal noise and one spike."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([np.full(n, v) for n, v in levels]) + rng.normal(
        0, sigma, sum(n for n, _ in levels)
    )
    x[3] += 20 * sigma  # a one-off pause moves no split
    return x


@pytest.mark.parametrize("seed", range(5))
def test_a_level_shift_is_found_at_its_step(seed):
    shift = level_shift(noisy([(23, 0.0), (17, 0.1)], 0.02, seed))
    assert shift is not None and shift.at == 23 and shift.z > 5
    assert shift.before == pytest.approx(0.0, abs=0.02) and shift.after == pytest.approx(
        0.1, abs=0.02
    )


@pytest.mark.parametrize("seed", range(5))
def test_noise_alone_stands_under_the_bar(seed):
    shift = level_shift(noisy([(40, 0.0)], 0.02, seed))
    assert shift is not None and shift.z < 3


def test_too_short_a_series_has_no_shift():
    assert level_shift(np.array([0.0, 1.0, 0.0])) is None


def test_the_timeline_dates_a_fault_that_begins_and_ends_inside_windows():
    """A straggler from step 17 to step 44 of 0..59, in windows of 10: named in the windows
    20-29 and 30-39 only (too few of its steps in the others); its series dates it."""
    f = {"kind": "straggler", "ranks": [3], "severity": 0.1}
    windows = [
        {"steps": [a, a + 9], "findings": [f] if a in (20, 30) else []} for a in range(0, 60, 10)
    ]
    level = pd.Series(np.where((np.arange(60) >= 17) & (np.arange(60) <= 44), 0.2, 0.0))
    level += noisy([(60, 0.0)], 0.01, 0)

    def series(kind: str, ranks: list[int], a: int, b: int) -> pd.Series:
        assert (kind, ranks) == ("straggler", [3])
        return level.loc[a:b]

    (plain,) = timeline(windows)
    assert (plain["first_step"], plain["last_step"]) == (20, 39)
    (dated,) = timeline(windows, series)
    assert (dated["first_step"], dated["last_step"]) == (17, 44)
    assert dated["onset"] == dated["end"] == "change_point"


def test_windows_date_a_slow_rank_from_mid_window_within_three_steps(tmp_path):
    """Rank 13 of 32 (dp4 x pp4 x tp2) turns 1.3x slow at step 47, mid-way through the window
    of steps 42-61; windows of 20 date it from its onset, not from the first window it is slow
    in wholly (step 62). (A run of 128 ranks slow from step 70, windows of 30, read 92 before
    the change point; the dating does not depend on the run's size, and 32 ranks cost a fifth
    of the time.)"""
    run = str(tmp_path / "late")
    megascope("synth", "--mesh", "dp=4,pp=4,tp=2", "--steps", "90", "--out", run, "--quiet",
              "--inject", "slow_rank:rank=13,factor=1.3,step=47")  # fmt: skip
    report = json.loads(
        megascope("analyze", run, "--windows", "20", "--json", "--no-whatif").stdout
    )
    assert [w["steps"] for w in report["windows"]][2] == [42, 61]
    (e,) = [e for e in report["timeline"] if e["kind"] == "straggler"]
    assert e["ranks"] == [13] and e["onset"] == "change_point"
    assert abs(e["first_step"] - 47) <= 3 and e["last_step"] == 89


@pytest.mark.parametrize(
    ("mesh", "rank", "onset"),
    [("dp=4,pp=2,tp=2", 5, 30), ("dp=2,pp=1,tp=2", 1, 20), ("dp=2,pp=1,tp=1", 1, 20)],
)
def test_a_rank_slow_from_part_way_is_one_straggler_from_its_onset(tmp_path, mesh, rank, onset):
    """Slow in half the steps or less: too few for the window's straggler test (75% of the
    steps); its level shift names it over the steps since. Its peers' steps rise with it from
    there: the step time drifts, and the drift is the straggler's (as a level shift, the
    regression detector reads the rank's lead rise with it; as a ramp, the straggler found
    explains it and it is dropped). With two ranks, what the other waits is the whole of the
    slow rank's excess over it (not over the median of the two: half)."""
    from analyzer.db import open_run
    from analyzer.findings import analyze, regression, step_window
    from analyzer.findings.common import Context

    run = str(tmp_path / "run")
    megascope("synth", "--mesh", mesh, "--steps", "60", "--out", run, "--quiet",
              "--inject", f"slow_rank:rank={rank},factor=2,step={onset}")  # fmt: skip
    db = open_run(run)
    try:
        report = analyze(db, whatif=False)
        lo, hi = step_window(db, None)
        series = Context(run=db, lo=lo, hi=hi).rank_steps.groupby("step").step_ns.median()
        drifted = regression.drift(series.index.to_numpy(), series.to_numpy(), 0.05)
    finally:
        db.close()
    (f,) = report["findings"]
    assert (f["kind"], f["ranks"], f["steps"]) == ("straggler", [rank], [onset, 59]), f
    assert f["evidence"]["work_ratio"] == pytest.approx(2.0, abs=0.1)
    if onset == 20:  # the step time drifts, and the one finding is the straggler
        assert drifted is not None
