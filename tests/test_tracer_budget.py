"""The tracer's own CPU time and the budget it keeps (tracer/budget.py): parts counted from each
thread's CPU clock, the flush interval widened over budget and narrowed back under it, capped by
what the buffers hold, and the summary that run.json records per rank."""

from __future__ import annotations

import threading
import time

from tracer.budget import MAX_WIDEN, MIN_REVIEW_NS, Budget


def _burn(ns: int) -> None:
    """Spend ``ns`` of this process's CPU time (a condition on the CPU clock, not a duration)."""
    end = time.process_time_ns() + ns
    while time.process_time_ns() < end:
        pass


def test_a_part_counts_the_cpu_time_of_the_thread_it_runs_in():
    b = Budget(0.01, 10, 5.0)

    def background() -> None:
        with b.part("flush"):
            end = time.thread_time_ns() + 20_000_000
            while time.thread_time_ns() < end:
                pass
        with b.part("watchdog"):
            time.sleep(0.05)  # waiting is not CPU time

    t = threading.Thread(target=background)
    t.start()
    t.join()
    by = b.by_part()
    assert by["flush"] >= 20_000_000
    assert by["watchdog"] < 20_000_000
    b.capture_ns += 1_000
    assert b.own_ns() == sum(b.by_part().values())


def test_over_budget_the_flush_interval_doubles_and_under_a_quarter_it_comes_back():
    b = Budget(0.01, 10, 5.0)
    assert not b.review()  # nothing to judge yet: under MIN_REVIEW_NS of the process's CPU
    _burn(2 * MIN_REVIEW_NS)
    b.add("flush", MIN_REVIEW_NS // 2)  # a quarter of the process's CPU: far over 1%
    assert b.review() and (b.flush_every_steps, b.flush_every_s) == (20, 10.0)
    for _ in range(5):
        _burn(2 * MIN_REVIEW_NS)
        b.add("flush", MIN_REVIEW_NS // 2)
        b.review()
    assert b.flush_every_steps == 10 * MAX_WIDEN  # never wider than that
    assert b.widenings == 3
    _burn(2 * MIN_REVIEW_NS)  # no tracer time at all since: the interval narrows, one halving
    assert b.review() and b.flush_every_steps == 10 * MAX_WIDEN // 2
    s = b.summary(steps=100)
    assert s["flush_every_steps"] == 40 and s["widenings"] == 3
    assert s["peak_share"] >= 0.2 and s["by_part"]["flush"] >= 3 * MIN_REVIEW_NS / 1e9


def test_capture_alone_over_budget_leaves_the_interval_as_it_is():
    """Only the flush gets cheaper with a wider interval; the hot path does not."""
    b = Budget(0.01, 10, 5.0)
    _burn(2 * MIN_REVIEW_NS)
    b.capture_ns += MIN_REVIEW_NS
    assert not b.review() and b.flush_every_steps == 10


def test_the_widening_never_holds_more_rows_than_half_the_buffer():
    b = Budget(0.01, 10, 5.0)
    b.limit_rows(rows_per_step=20_000, max_rows=1_000_000)  # 200k rows per interval of 10
    assert b.max_widen == 2
    for _ in range(3):
        _burn(2 * MIN_REVIEW_NS)
        b.add("flush", MIN_REVIEW_NS)
        b.review()
    assert b.flush_every_steps == 20


def test_a_zero_budget_is_recorded_and_the_summary_reads_per_step():
    b = Budget(0.0, 10, 5.0)
    b.capture_ns += 4_000_000
    s = b.summary(steps=4)
    assert s["ms_per_step"] == 1.0 and s["budget"] == 0.0
    assert Budget(0.01, 10, 5.0).summary(steps=0)["ms_per_step"] is None


def test_a_run_watched_live_writes_each_step_within_its_budget(tmp_path):
    """`megascope watch` leaves a marker in the run directory; while it is fresh the tracer
    flushes at each step (at most every WATCHED_FLUSH_S), the flushes' own share against ten
    times the budget widening that gap instead of the interval in steps; once it is gone, the
    configured interval comes back."""
    from tracer.budget import WATCHED_FLUSH_S, WATCHED_MAX_S
    from tracer.rundir import mark_watched, unmark_watched, watched

    run = str(tmp_path)
    assert not watched(run)
    mark_watched(str(tmp_path / "not-yet"))  # a run directory not made yet: nothing happens
    assert not (tmp_path / "not-yet").exists()
    b = Budget(0.01, 10, 5.0)
    assert b.flush_gap_ns == 0
    _burn(2 * MIN_REVIEW_NS)
    b.add("flush", MIN_REVIEW_NS)
    assert b.review(watched=watched(run)) and b.flush_every_steps == 20
    mark_watched(run)
    assert watched(run)
    assert b.review(watched=watched(run)) and b.flush_every_steps == 1
    assert b.flush_gap_ns == int(WATCHED_FLUSH_S * 1e9) and b.flush_every_s == 5.0
    _burn(10 * MIN_REVIEW_NS)  # flushes at 5%: over the budget, within a watch's ten times it
    b.add("flush", MIN_REVIEW_NS // 2)
    assert not b.review(watched=True) and b.flush_gap_ns == int(WATCHED_FLUSH_S * 1e9)
    for _ in range(4):  # over a watch's budget: the gap widens, never past its cap
        _burn(2 * MIN_REVIEW_NS)
        b.add("flush", MIN_REVIEW_NS)
        assert not b.review(watched=True) and b.flush_every_steps == 1
    assert b.flush_gap_ns == int(WATCHED_MAX_S * 1e9)
    _burn(2 * MIN_REVIEW_NS)  # under a quarter of the budget: it narrows back
    b.review(watched=True)
    assert b.flush_gap_ns == int(WATCHED_MAX_S / 2 * 1e9)
    unmark_watched(run)  # the watch stops: its marker goes
    assert not watched(run)
    assert b.review(watched=watched(run)) and b.flush_every_steps == 10 and b.flush_gap_ns == 0
    off = Budget(0.0, 10, 5.0)  # no budget (review never runs): the marker still counts
    assert off.watch(True) and off.flush_every_steps == 1 and not off.watch(True)


def test_a_watch_marker_is_fresh_while_its_watch_beats(tmp_path):
    """The marker's freshness is its age: fresh under WATCHED_S, stale past it (a watch killed
    outright); a watch that stops removes its own marker, never another's."""
    import json
    import os

    from analyzer.live import WatchMarker
    from tracer.rundir import WATCHED_S, WATCHING, marker_fresh, unmark_watched, watched

    assert not marker_fresh(None, 100.0)
    assert marker_fresh(100.0, 100.0) and marker_fresh(100.0, 100.0 + WATCHED_S - 0.1)
    assert marker_fresh(100.5, 100.0)  # the writer's clock a little ahead
    assert not marker_fresh(100.0, 100.0 + WATCHED_S)
    run = str(tmp_path)
    watch = WatchMarker(run)
    marker = tmp_path / WATCHING
    deadline = time.monotonic() + 2
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    body = json.loads(marker.read_text())
    assert body["pid"] == os.getpid() and watched(run)
    old = time.time() - WATCHED_S - 1
    os.utime(marker, (old, old))  # a marker left by a watch gone long ago
    assert not watched(run)
    deadline = time.monotonic() + 3 * watch.every  # the beat makes it fresh again
    while not watched(run) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watched(run)
    watch.stop()
    assert not marker.exists() and not watched(run)
    marker.write_text(json.dumps({"host": "elsewhere", "pid": os.getpid()}))
    unmark_watched(run)  # another watch's marker stays
    assert marker.exists()


def test_a_rank_without_run_json_on_its_disk_keeps_its_entry_for_gather(tmp_path):
    """A node's own disk has no run.json (node 0's holds it): a rank's by-rank entries go to
    .ranks/, and gather folds them into the run.json it writes, run.json's own entry winning."""
    from tracer.rundir import fold_rank_notes, record_for_rank, write_json_atomic

    node1, node0 = tmp_path / "node1", tmp_path / "node0"
    node1.mkdir()
    node0.mkdir()
    where = record_for_rank(str(node1), 3, "tracer_cpu", {"cpu_s": 1.5})
    record_for_rank(str(node1), 3, "dropped", {"spans": 7})
    assert where.endswith(".ranks/rank-00003.json") and not (node1 / "run.json").exists()
    write_json_atomic(str(node0 / "run.json"), {"tracer_cpu": {"0": {"cpu_s": 2.0}}})
    assert record_for_rank(str(node0), 0, "dropped", {"spans": 1}).endswith("run.json")
    meta = {"tracer_cpu": {"3": {"cpu_s": 9.0}}}
    assert fold_rank_notes(str(node1), meta) == 1
    assert meta == {"tracer_cpu": {"3": {"cpu_s": 9.0}}, "dropped": {"3": {"spans": 7}}}


def test_watched_ranks_flush_the_same_steps_where_steps_are_short():
    """While watched, steps shorter than the watched gap (0.5 s) are flushed every k steps, k a
    power of two, at multiples of k: two ranks whose step times read a little apart flush
    steps one of them holds all of, so the newest step every rank wrote moves with each."""
    ranks = []
    for step_s in (0.24, 0.26):  # k = 4 and k = 2
        b = Budget(0.01, 10, 5.0)
        assert b.watch(True)
        for _ in range(5):
            b.stepped(int(step_s * 1e9))
        ranks.append({n for n in range(1, 33) if b.watched_due(n)})
    assert ranks[0] == set(range(4, 33, 4)) and ranks[1] == set(range(2, 33, 2))
    assert ranks[0] <= ranks[1]
    long_steps = Budget(0.01, 10, 5.0)
    long_steps.watch(True)
    long_steps.stepped(int(0.8e9))
    assert all(long_steps.watched_due(n) for n in range(1, 10))  # each step
