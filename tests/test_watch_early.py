"""A watch names a rank that turned slow from its digests, three slow steps after its onset,
before a full look reads those steps; the full look then confirms it. On recorded runs of 4
ranks sharing 2 cores (tests/data/cpu_runs/dp4_*), each window as a live pulse would read it,
and on a running run written by ``synth``. And what a live look does not take for a hang."""

from __future__ import annotations

import os
import time

import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers.cli import megascope
from helpers.paths import DATA

from tracer.rundir import read_run_json, write_json_atomic

WINDOW = 20
ONSET = 20  # dp4_slow1_from20: rank 1 sleeping 2x its compute from step 20


def _pulse_at(src: str, dst: str, hi: int):
    """The beat of a pulse over ``src``'s digests as they stood when step ``hi`` was the newest
    every rank had written (the run still training)."""
    from analyzer.pulse import Pulse

    os.makedirs(dst)
    meta = read_run_json(src)
    write_json_atomic(os.path.join(dst, "run.json"), {**meta, "status": "running"})
    for rank_dir in sorted(os.listdir(os.path.join(src, "digests"))):
        out = os.path.join(dst, "digests", rank_dir)
        os.makedirs(out)
        for name in os.listdir(os.path.join(src, "digests", rank_dir)):
            table = pq.read_table(os.path.join(src, "digests", rank_dir, name))
            pq.write_table(table.filter(pc.less_equal(table["step"], hi)), os.path.join(out, name))
    pulse = Pulse(dst)
    try:
        return pulse.look(WINDOW)
    finally:
        pulse.close()


def test_a_pulse_names_the_rank_at_its_third_slow_step_on_shared_cores(tmp_path):
    """4 ranks on 2 cores, where a rank's own time swings by a tenth of a step from step to
    step: less its wait for a core (the digests' ``step_runq_ns``), rank 1's shift stands out
    from its third slow step, and not before; its factor reads about the 2x injected."""
    src = os.path.join(DATA, "cpu_runs", "dp4_slow1_from20")
    turns = {hi: _pulse_at(src, str(tmp_path / f"at{hi}"), hi).turns for hi in (19, 20, 21, 22, 30)}
    assert turns[19] == [] and turns[20] == [] and turns[21] == []
    for hi in (22, 30):
        (t,) = turns[hi]
        assert (t.rank, t.at, t.steps) == (1, ONSET, hi - ONSET + 1)
        assert 1.6 < t.factor < 2.6


def test_a_pulse_reads_once_every_rank_behind_the_newest_step_wrote_again(tmp_path):
    """While the run trains, a pulse reads the new digests once the window's end can move:
    rank 3's flush of steps 24-27, after the others', is the one that moves it; read before
    it, the others' would hold up the read of rank 3's."""
    from analyzer.pulse import Pulse

    src = os.path.join(DATA, "cpu_runs", "dp4_slow1_from20")
    dst = str(tmp_path / "run")
    os.makedirs(dst)
    write_json_atomic(os.path.join(dst, "run.json"), {**read_run_json(src), "status": "running"})

    def flush(rank: int, lo: int, hi: int) -> None:
        """Rank ``rank``'s digests of steps ``lo``..``hi`` as a part of its own."""
        name = f"rank={rank:05d}"
        (comp,) = os.listdir(os.path.join(src, "digests", name))
        table = pq.read_table(os.path.join(src, "digests", name, comp))
        keep = pc.and_(pc.greater_equal(table["step"], lo), pc.less_equal(table["step"], hi))
        os.makedirs(os.path.join(dst, "digests", name), exist_ok=True)
        pq.write_table(table.filter(keep), os.path.join(dst, "digests", name, f"part-{hi}.parquet"))

    pulse = Pulse(dst)
    try:
        for rank in range(4):
            flush(rank, 0, 23)
        assert pulse.look(WINDOW).steps == (4, 23)  # every rank closed step 23
        for rank in range(3):
            flush(rank, 24, 27)
            beat = pulse.look(WINDOW)
            assert (beat.read_steps, beat.steps) == (0, (4, 23)), rank  # not read: rank 3 behind
        flush(3, 24, 27)
        beat = pulse.look(WINDOW)
        assert beat.steps == (8, 27) and beat.read_steps > 0
        assert [(t.rank, t.at) for t in beat.turns] == [(1, ONSET)]
    finally:
        pulse.close()


def test_a_healthy_run_on_shared_cores_turns_no_rank_in_any_window(tmp_path):
    """The same shape, no fault, 60 steps: no window of the pulse names a rank."""
    from analyzer.findings.common import Thresholds
    from analyzer.findings.onset import turned
    from analyzer.pulse import Pulse

    pulse = Pulse(os.path.join(DATA, "cpu_runs", "dp4_healthy"))
    try:
        pulse.look(1000)  # every step's digests, as the pulse's rows
        rows = pulse.rows
    finally:
        pulse.close()
    own = rows.work_ns.astype(float) - pd.to_numeric(rows.runq_ns).fillna(0.0)
    rows = rows.assign(pp=rows.cls, work_ns=own.clip(lower=0.0))
    assert rows.runq_ns.notna().all()  # the tracer digested each step's wait for a core
    for hi in range(WINDOW + 1, int(rows.step.max()) + 1):
        window = rows[(rows.step > hi - WINDOW) & (rows.step <= hi)]
        assert turned(window, Thresholds()) == [], hi


@pytest.fixture
def running_slow(tmp_path) -> str:
    """A synth run of 8 ranks whose rank 5 turned 1.5x slow 4 steps before its end, as its
    run.json would say while it still trained (its newest step, 29, may be written in part:
    a look reads to 28)."""
    run = str(tmp_path / "run")
    megascope("synth", "--mesh", "dp=4,pp=1,tp=2", "--steps", "30", "--out", run, "--quiet",
              "--inject", "slow_rank:rank=5,factor=1.5,step=26", check=True)  # fmt: skip
    meta = read_run_json(run)
    write_json_atomic(os.path.join(run, "run.json"), {**meta, "status": "running"})
    return run


def test_a_watch_names_a_turned_rank_before_its_full_look_which_confirms_it(running_slow):
    from analyzer.live import Looks

    looks = Looks(running_slow, WINDOW, whatif=False)
    try:
        early = looks.next([])  # the pulse's digests name rank 5: no full look yet
        assert looks.last_full is None
        (f,) = early.findings
        assert (f["kind"], f["ranks"], f["steps"]) == ("straggler", [5], [26, 28])
        assert f["evidence"]["early"] and f["coords"] == [{"dp": 2, "pp": 0, "tp": 1, "cp": 0}]
        assert looks.full_due
        looks.wait(600.0)  # returns at once: the full look is due
        full = looks.next(early.findings)
        assert looks.last_full is not None and not looks.full_due
        assert [(g["kind"], g["ranks"]) for g in full.findings] == [("straggler", [5])]
        assert "early" not in full.findings[0]["evidence"]  # the full look's own record
        assert looks.early == {} and looks.refuted == set()
        again = looks.next(full.findings)  # named: not named early again
        assert again.findings == full.findings
    finally:
        looks.close()


def test_a_watch_s_full_looks_run_beside_its_pulse(running_slow):
    """As ``megascope watch`` takes them: a full look runs in a process of its own, the pulse's
    looks come meanwhile, and the full look's findings land at a later look, as its verdict."""
    from analyzer.live import Looks

    looks = Looks(running_slow, WINDOW, whatif=False, background=True)
    try:
        early = looks.next([])
        assert [(f["kind"], f["ranks"]) for f in early.findings] == [("straggler", [5])]
        seen, deadline = early, time.monotonic() + 120
        while not seen.full and time.monotonic() < deadline:
            looks.wait(0.2)
            seen = looks.next(seen.findings)  # a pulse's look until the full one lands
            assert seen is not None and [f["ranks"] for f in seen.findings] == [[5]]
        assert seen.full and "early" not in seen.findings[0]["evidence"]
        assert looks.early == {} and looks.refuted == set() and looks.pending is None
    finally:
        looks.close()


def _straggler(rank: int, steps: list[int]) -> dict:
    return {"kind": "straggler", "ranks": [rank], "steps": steps, "evidence": {"early": True}}


def test_a_rank_named_early_that_a_full_look_does_not_name_is_taken_back():
    """The full look is the verdict: a rank named early that it does not name, once it read the
    step the rank was named at, is taken back; one it has not read that far stays."""
    from analyzer.live import Look, taken_back

    early = {
        ("straggler", (5,)): _straggler(5, [26, 29]),
        ("straggler", (2,)): _straggler(2, [28, 31]),
    }
    seen = Look("running", (10, 29), [_straggler(2, [27, 29])])  # type: ignore[list-item]
    assert taken_back(early, seen) == {("straggler", (5,))}  # type: ignore[arg-type]
    assert taken_back(early, Look("running", (9, 28), [])) == set()  # type: ignore[arg-type]
    assert taken_back(early, Look("running", (12, 31), [])) == set(early)  # type: ignore[arg-type]


def test_a_full_look_begun_before_a_rank_was_named_early_leaves_it_standing(running_slow):
    """A full look that read fewer steps than the pulse named a rank from (begun before them)
    neither takes the rank back nor names its onset's first steps as a transient stall."""
    from analyzer.live import Look, Looks

    looks = Looks(running_slow, WINDOW, whatif=False)
    try:
        early = looks.next([])
        (f,) = early.findings
        stall = {"kind": "transient_stall", "ranks": [5], "steps": [8, 27],
                 "evidence": {"stall_steps": [26, 27]}}  # fmt: skip
        other = {"kind": "straggler", "ranks": [3], "steps": [8, 27], "evidence": {}}
        older = Look("running", (8, 27), [stall, other])  # type: ignore[list-item]
        judged = looks.judge(older)
        assert judged.findings == [other, f] and looks.early and not looks.refuted
    finally:
        looks.close()


def test_a_live_look_takes_a_rank_behind_its_peers_for_a_hang_only_once_it_is_stuck():
    """While a run trains, ranks are read as of their last flush, and a slow rank is behind its
    peers at every instant: a root of the wait graph is stuck where its own watchdog said so,
    or where no rank was heard from for the hang timeout."""
    from analyzer.findings.hang import live_roots

    now = 10**18
    activity = pd.DataFrame({"rank": [0, 1, 2], "last_ts_ns": [now - 10**9] * 3,
                             "has_hang_beat": [False, False, False],
                             "n_hang_stacks": [0, 0, 0]})  # fmt: skip
    assert live_roots([1], activity, 60.0, now) == []
    said = activity.assign(has_hang_beat=[False, True, False])
    assert live_roots([1], said, 60.0, now) == [1]
    stacked = activity.assign(n_hang_stacks=[0, 0, 2])
    assert live_roots([1, 2], stacked, 60.0, now) == [2]
    silent = activity.assign(last_ts_ns=[now - 61 * 10**9] * 3)
    assert live_roots([1], silent, 60.0, now) == [1]
