"""``megascope watch`` at its default settings on a real run while it trains: a rank made slow
from step 20 on is announced as the straggler after its onset, within 10 steps, and /metrics
answers with per-rank series (live);
on finished runs and written ones, what watch, its pulses and the dashboard's live findings say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers.cli import megascope, megascope_popen
from helpers.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ONSET = 20  # the first slow step of the default-settings test
# steps after the onset by which the line must have come: how many it takes at default settings
# (the target is 3) is bench/watch_alert.py's to measure, over many runs; a test asserts only
# that it follows the onset, names the rank, and comes while the run still trains
WITHIN = 10


@pytest.mark.solo
def test_at_default_settings_a_watch_names_a_rank_after_its_onset_and_serves_metrics(
    tmp_path, launch
):
    """A watch at its default settings beside a training at the tracer's defaults (no
    MEGASCOPE_FLUSH_STEPS): its marker makes the tracers write each step as it ends, so the
    first straggler line names the slowed rank from a look that reads the slow steps, no line
    comes before the onset, and the rank had begun at most WITHIN steps past the onset when it
    came (steps counted from the run's own step spans, not seconds). Its Prometheus endpoint
    serves the findings and each rank's compute meanwhile."""
    from analyzer.db import open_run

    run, port = str(tmp_path / "run"), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGASCOPE_")}
    watcher = megascope_popen("watch", run, "--metrics-port", str(port), env=env)
    lines: list[tuple[int, str]] = []

    def read() -> None:
        assert watcher.stdout is not None
        for line in watcher.stdout:
            lines.append((time.time_ns(), line))

    import threading

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    train = launch([sys.executable, "-m", "analyzer", "train", "--dp", "2",
                    "--micro-batch-size", "32", "--steps", "40", "--out", run,
                    "--inject", f"slow_rank:rank=1,factor=2,step={ONSET}"], env=env,
                   text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    metrics = ""
    try:
        deadline = time.monotonic() + 400
        while train.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    body = r.read().decode()
                if 'megascope_findings{kind="straggler"}' in body:
                    metrics = body
            except OSError:
                pass
            time.sleep(1)
        assert train.wait(timeout=60) == 0, train.stdout.read()
        watcher.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        for p in (train, watcher):
            if p.poll() is None:
                p.kill()
    out = "".join(line for _, line in lines)
    assert watcher.returncode in (0, 3), out
    alerts = [(at, m) for at, line in lines
              if (m := re.search(r"steps (\d+)-(\d+): \+ (\w+) ([\d, ]+) ", line))]  # fmt: skip
    assert all(int(m.group(2)) >= ONSET for _, m in alerts), out  # nothing before the onset
    stragglers = [(at, m) for at, m in alerts if m.group(3) == "straggler"]
    assert stragglers, out
    at, first = stragglers[0]
    assert first.group(4).strip() == "1", out
    db = open_run(run)
    try:
        starts = db.sql("select step, min(start_ns) as t from spans "
                        "where name = 'step' and rank = 1 group by step")  # fmt: skip
    finally:
        db.close()
    begun = int((starts.t <= at).sum()) - 1  # the newest step rank 1 had begun
    assert ONSET <= begun <= ONSET + WITHIN, (begun, out)
    assert not (tmp_path / "run" / ".watching").exists()  # the watch took its marker away
    assert 'megascope_findings{kind="straggler"}' in metrics, metrics
    for rank in range(2):
        assert f'megascope_rank_compute_seconds{{rank="{rank}"}}' in metrics
    assert re.search(r"^megascope_last_step \d", metrics, re.M)


def test_watch_on_a_finished_run_says_so_and_exits():
    healthy = megascope("watch", "samples/healthy", "--interval", "0.1", timeout=120)
    assert healthy.returncode == 0, healthy.stderr
    assert healthy.stdout.splitlines()[-1] == "run finished; 0 finding(s) active"
    slow = megascope("watch", "samples/slow_rank", "--interval", "0.1", "--window", "18",
                     timeout=120)  # fmt: skip
    assert slow.returncode == 3, slow.stderr
    assert "+ straggler 5 " in slow.stdout
    assert slow.stdout.splitlines()[-1] == "run finished; 1 finding(s) active"


def test_the_dashboards_live_findings_are_watchs(tmp_path):
    from helpers.small_run import write_small_run

    from analyzer.live import WINDOW, look
    from dashboard.source import RunSource

    mesh = {"dp": 2, "pp": 2, "tp": 1}
    run = write_small_run(str(tmp_path / "live"), mesh, steps=4, status="running", slow_rank=3)
    src = RunSource(run)
    early = src.findings(None)  # too few steps yet: none, as watch
    assert early["findings"] == [] and "live" in early["note"]
    assert look(run, WINDOW, True).findings == []
    write_small_run(run, mesh, steps=WINDOW, status="running", slow_rank=3, first_step=4)
    src.refresh()
    seen = look(run, WINDOW, True)
    report = src.findings(None)
    # not the whole run, and not its newest step: a run without `step` spans may have flushed
    # only part of it
    assert report["run"]["steps"] == list(seen.steps) == [3, WINDOW + 2]
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [
        (f["kind"], f["ranks"]) for f in seen.findings
    ]
    assert ("straggler", [3]) in [(f["kind"], f["ranks"]) for f in seen.findings]


def test_a_pulse_reads_only_the_new_steps_and_agrees_with_a_full_look(tmp_path):
    """Between full looks, a watch reads the digests of the steps it has not read: of files
    rewritten in place and of files it has not seen, up to the newest complete step."""
    from helpers.small_run import write_small_run

    from analyzer.digests import write_digests
    from analyzer.live import look
    from analyzer.pulse import Pulse
    from tracer.rundir import read_run_json, write_json_atomic

    mesh = {"dp": 4, "pp": 2, "tp": 1}
    run = write_small_run(str(tmp_path / "live"), mesh, steps=8, status="running", slow_rank=5)
    write_digests(run)
    pulse = Pulse(run)
    try:
        early = pulse.look(10)
        # steps 0-6: while the run trains, a rank's newest step may be written in part (the
        # run has no `step` spans to say it closed)
        assert (early.steps, early.read_steps, early.world) == (None, 7, 8)
        write_small_run(run, mesh, steps=8, status="running", slow_rank=5, first_step=8)
        write_digests(run)  # the same files, rewritten with steps 0-15
        beat = pulse.look(10)
        assert (beat.steps, beat.read_steps) == ((5, 14), 8)  # steps 7-14
        assert beat.suspects == {5}
        assert pulse.look(10).read_steps == 0  # nothing new
        meta = read_run_json(run)
        write_json_atomic(os.path.join(run, "run.json"), {**meta, "status": "finished"})
        last = pulse.look(10)  # the run ended: its newest step is whole
        assert (last.steps, last.read_steps, last.status) == ((6, 15), 1, "finished")
    finally:
        pulse.close()
    full = look(run, 10, False)
    assert full.steps == last.steps
    assert last.step_s == pytest.approx(full.step_s, abs=1e-6)  # the report rounds to µs
    assert last.compute_s == pytest.approx(full.compute_s, rel=1e-9)
    assert ("straggler", [5]) in [(f["kind"], f["ranks"]) for f in full.findings]


def test_past_its_full_looks_a_watch_pulses_until_the_screen_names_a_new_rank(tmp_path):

    from helpers.small_run import write_small_run

    from analyzer.digests import write_digests
    from analyzer.live import Looks

    run = write_small_run(str(tmp_path / "live"), {"dp": 4, "pp": 2}, steps=16,
                          status="running", slow_rank=5)  # fmt: skip
    write_digests(run)
    looks = Looks(run, 10, whatif=False, full_every=1000.0)
    try:
        first = looks.next([])  # the first look is in full
        assert ("straggler", [5]) in [(f["kind"], f["ranks"]) for f in first.findings]
        full_at = looks.last_full
        kept = [{"kind": "kept", "ranks": [0]}]
        second = looks.next(kept)  # a pulse: the findings stand, the metrics are the pulse's
        assert looks.last_full == full_at and second.findings == kept
        assert second.compute_s == first.compute_s and second.steps == first.steps
        looks.screened = frozenset()  # as if rank 5 had not been screened at the last full look
        third = looks.next(kept)
        assert looks.last_full > full_at and third.findings != kept
    finally:
        looks.close()

    no_digests = write_small_run(str(tmp_path / "older"), {"dp": 2}, steps=12)
    looks = Looks(no_digests, 10, whatif=False, full_every=1000.0)
    try:
        assert looks.pulse.look(10) is None  # no digests stored: every look is in full
        assert looks.next([]).steps == (2, 11)
    finally:
        looks.close()


def test_a_watch_looks_as_soon_as_every_rank_has_written_a_new_step(tmp_path):
    """Between looks a watch waits for a step every rank has written (from the digests'
    listing), not for its interval: here an interval of ten minutes, and the steps written a
    moment after the look. It waits for the end of the run the same way."""
    import threading

    from helpers.small_run import write_small_run

    from analyzer.digests import write_digests
    from analyzer.live import Looks
    from tracer.rundir import read_run_json, write_json_atomic

    mesh = {"dp": 4, "pp": 2, "tp": 1}
    run = write_small_run(str(tmp_path / "live"), mesh, steps=8, status="running")
    write_digests(run)
    looks = Looks(run, 4, whatif=False)

    def waited() -> bool:  # whether wait() returned within a minute of the new files
        waiting = threading.Thread(target=looks.wait, args=(600.0,), daemon=True)
        waiting.start()
        return (waiting.join(60), not waiting.is_alive())[1]

    try:
        assert looks.next([]).steps == (3, 6)  # the newest step, 7, may be written in part
        time.sleep(0.3)
        write_small_run(run, mesh, steps=8, status="running", first_step=8)
        write_digests(run)
        assert waited()
        assert looks.next([]).steps == (11, 14)
        meta = read_run_json(run)
        write_json_atomic(os.path.join(run, "run.json"), {**meta, "status": "finished"})
        assert waited()
        last = looks.next([])
        assert (last.status, last.steps) == ("finished", (12, 15))
    finally:
        looks.close()


@pytest.mark.parametrize(("mesh", "rank"), [("dp=4,pp=1,tp=2", 5), ("dp=2,pp=2,tp=2", 2)])
def test_a_look_names_a_straggler_three_steps_after_it_began(tmp_path, mesh, rank):
    """A rank slow for the window's last 3 steps only: too few for the detectors over the
    window (they want it slow in most steps); the level shift of its series finds them."""
    from analyzer.findings.onset import MIN_AFTER
    from analyzer.live import look

    run = str(tmp_path / "run")
    megascope("synth", "--mesh", mesh, "--steps", "30", "--out", run, "--quiet",
              "--inject", f"slow_rank:rank={rank},factor=1.5,step={30 - MIN_AFTER}")  # fmt: skip
    seen = look(run, 20, whatif=False)
    assert seen is not None and seen.steps == (10, 29)
    named = [(f["kind"], f["ranks"]) for f in seen.findings]
    assert named == [("straggler", [rank])], seen.findings
    (f,) = seen.findings
    assert f["steps"] == [30 - MIN_AFTER, 29]  # the steps from its onset on
    healthy = str(tmp_path / "healthy")
    megascope("synth", "--mesh", mesh, "--steps", "30", "--out", healthy, "--quiet")
    seen = look(healthy, 20, whatif=False)
    assert seen is not None and seen.findings == []


def test_on_shared_cores_a_look_names_a_rank_three_steps_after_it_turned_slow():
    """A live run of 2 ranks on 2 cores, the tracer flushing every step and a watch beside it
    (tests/data/cpu_runs/dp2_slow1_from20: rank 1 2x from step 20). Before the fault the two
    ranks' own times differ by up to a third of a step from step to step, mostly their wait
    for a core; left out, the level shift of rank 1 stands out after 3 slow steps (it did not
    before: it took 5). Each look is a watch's window of 20 steps."""
    from helpers.paths import DATA

    from analyzer.db import open_run
    from analyzer.findings import analyze

    db = open_run(os.path.join(DATA, "cpu_runs", "dp2_slow1_from20"))
    try:
        looks = {hi: analyze(db, steps=(max(hi - 19, 2), hi), whatif=False)["findings"]
                 for hi in (19, 20, 22, 23, 24, 39)}  # fmt: skip
    finally:
        db.close()
    assert looks[19] == [] and looks[20] == []  # no alarm before the fault, nor at its 1st step
    for hi in (22, 23, 24, 39):  # from its 3rd slow step: one straggler, from step 20
        assert [(f["kind"], f["ranks"], f["steps"]) for f in looks[hi]] == [
            ("straggler", [1], [20, hi])
        ], looks[hi]


def _looks(name: str, his: list[int]) -> dict[int, list[dict]]:
    """The findings of a watch's looks (20 steps) at a recorded run, ending at each of ``his``."""
    from helpers.paths import DATA

    from analyzer.db import open_run
    from analyzer.findings import analyze

    db = open_run(os.path.join(DATA, "cpu_runs", name))
    try:
        return {hi: analyze(db, steps=(max(hi - 19, 2), hi), whatif=False)["findings"]
                for hi in his}  # fmt: skip
    finally:
        db.close()


def _shifts(name: str, hi: int) -> tuple[float, dict[int, float]]:
    """Over a look's steps ending at ``hi``: how far the step time shifted (standard errors),
    and each rank's excess of own work by itself (analyzer.findings.onset)."""
    from helpers.paths import DATA

    from analyzer.changepoint import level_shift
    from analyzer.db import open_run
    from analyzer.findings.common import Context, Thresholds
    from analyzer.findings.onset import MIN_AFTER, excess_of

    db = open_run(os.path.join(DATA, "cpu_runs", name))
    try:
        ctx = Context(db, max(hi - 19, 2), hi, Thresholds())
        step = ctx.rank_steps.groupby("step").step_ns.median().sort_index().to_numpy()
        frame = excess_of(ctx, "work_ns")
        own = {int(r): level_shift(frame[r].dropna().to_numpy(), MIN_AFTER).z for r in frame}
        return level_shift(step, MIN_AFTER).z, own
    finally:
        db.close()


def test_a_rank_that_leads_the_run_s_slowdown_is_named_at_its_third_slow_step():
    """Rank 1 2x from step 20 on 2 ranks sharing 2 cores whose own times still swing by a third
    of a step before the fault (tests/data/cpu_runs/dp2_slow1_from20_late). At its 3rd slow
    step, rank 1's excess by itself stands under the onset's bar; the run's step time shifted
    far more, and rank 1's excess rose with it by as much: the look names it then (before, from
    its 6th slow step)."""
    from analyzer.findings.onset import ONSET_Z

    step_z, own_z = _shifts("dp2_slow1_from20_late", 22)
    assert own_z[1] < ONSET_Z <= step_z  # the case: the rank alone does not stand out
    looks = _looks("dp2_slow1_from20_late", [19, 20, 21, 22, 23, 24])
    assert looks[19] == [] and looks[20] == [] and looks[21] == []
    for hi in (22, 23, 24):
        assert [(f["kind"], f["ranks"], f["steps"]) for f in looks[hi]] == [
            ("straggler", [1], [20, hi])
        ], looks[hi]


def test_a_healthy_run_whose_step_time_shifts_up_names_no_rank():
    """A healthy run of 2 ranks on 2 cores (tests/data/cpu_runs/dp2_healthy_step_shift) whose
    step time shifts up 60% at step 22, both ranks alike (the host): no rank led it, and no look
    names one."""
    from analyzer.findings.onset import ONSET_Z

    step_z, _ = _shifts("dp2_healthy_step_shift", 24)
    assert step_z >= ONSET_Z  # the case: the run slowed as much as a fault's onset reads
    looks = _looks("dp2_healthy_step_shift", list(range(21, 40)))
    assert all(found == [] for found in looks.values()), looks
