"""The tracer's own CPU time, and the budget it keeps by itself.

Always-on means the tracer's cost is a number it knows, not one a benchmark finds later. It
counts its own time by part:

* ``start``: attach's own work (the clock's first estimate, imports, the first files);
* ``capture``: the training thread's bookkeeping in the hot path (the collective wrappers and
  their works' ``wait``, spans, the step clock), summed from ``perf_counter_ns`` stamps around
  it (about 50 ns each; a thread CPU clock would cost ten times that, a system call, on every
  collective). The training thread runs that code without blocking, so its wall time is its
  CPU time;
* ``flush``: the flusher's rounds (reading Flight Recorder, rows to columns, Parquet, digests,
  compaction); ``close``: the last flush, which merges every table's parts (after the
  training, or after a hang); ``watchdog``, ``clock`` (the offset re-estimates) and ``nvml`` (the sampler):
  each thread's own CPU time (``thread_time_ns``) around each round of work.

At every flush :meth:`Budget.review` sets the tracer's CPU since the previous review against
the process's (``process_time_ns``: every thread of the rank, the training's included). Over
``cpu_budget`` (a share, 1% by default), the flush interval doubles (in steps and in seconds), up to :data:`MAX_WIDEN` times the configured one; it comes
back one halving at a time once the share is under a quarter of the budget, and at once to
the configured interval while ``megascope watch`` follows the run.

**While a watch follows the run** (its marker in the run directory is fresh, read with one
``stat`` at each flush: tracer/rundir.py), the tracer writes each step as it ends, and at most
every :data:`WATCHED_FLUSH_S` seconds where steps are shorter (then every 2, 4, ... steps, the
same steps on every rank: :meth:`Budget.watched_due`), so that a look reads a step as soon as
every rank closed it. That cadence answers to a budget of its own, the flushes' share
alone against :data:`WATCHED_BUDGET_TIMES` times ``cpu_budget`` (10% by default: a watch is a
session a user opens to see each step; a flush costs a few milliseconds, under 1% of a busy
core at two a second, but a rank of a small CPU run uses a third of a core): over it, the least
time between two watched flushes doubles (up to :data:`WATCHED_MAX_S`), and halves back once
under a quarter of it. Nothing recorded
is dropped for it: a wider interval only holds more rows in memory (at most ``max_rows`` per
table, whose widening is capped to keep the rows of one interval under half of that), and
Flight Recorder's ring is read early, whatever the interval, once it is half full
(``FlightReader.backlog``). The capture cost is the tracer's floor: no interval changes it.

:meth:`Budget.summary` is what each rank writes into run.json's ``tracer_cpu`` at close
(docs/spec.md §1).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

PARTS = ("start", "capture", "flush", "close", "watchdog", "clock", "nvml")
MAX_WIDEN = 8  # the widest flush interval, in multiples of the configured one
NARROW_BELOW = 0.25  # of the budget: under it, a widened interval narrows again
MIN_REVIEW_NS = 50_000_000  # the process's CPU a review needs to judge a share (50 ms)
WATCHED_FLUSH_S = 0.5  # while watched: a flush at each step, at most this often
WATCHED_MAX_S = 2.0  # while watched, the budget widens that gap up to this
# while watched, the flushes alone may take this many times the budget before the gap widens:
# a watch is a session a user opens to see each step (docs/benchmarks.md: the cost measured)
WATCHED_BUDGET_TIMES = 10
MAX_WATCH_STEPS = 64  # while watched, a flush every this many steps at least


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a flush.

    A flush makes tens of thousands of short-lived objects (an unpickled Flight Recorder ring
    alone is a dict and lists per entry): enough to set off full collections, and a full
    collection walks the whole heap of a process that loaded torch (about 70 ms, measured) with
    the GIL held, stopping the training thread with it. What a flush makes is freed by
    reference counting before the collector resumes, so nothing is left for it; pausing it took
    a read of a 2,000-entry ring from 130 ms to 12 (docs/benchmarks.md). A collector that the
    program itself turned off stays off.
    """
    was = gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Budget:
    """One rank's count of the tracer's CPU time, and the flush interval it allows."""

    def __init__(self, share: float, flush_every_steps: int, flush_every_s: float) -> None:
        self.share = share
        self.base_steps = max(1, flush_every_steps)
        self.base_s = flush_every_s
        self.widen = 1  # the flush interval is this many times the configured one
        self.widenings = 0  # times it was widened
        self.capture_ns = 0  # added to by the training thread (one writer: no lock)
        self._ns = {p: 0 for p in PARTS if p != "capture"}
        self._lock = threading.Lock()  # the background threads' parts
        self._proc0 = time.process_time_ns()
        self._seen_proc = self._proc0
        self._seen_own = 0
        self._seen_flush = 0
        self._peak = 0.0  # the largest share one review saw
        self._warned = False
        self.max_widen = MAX_WIDEN
        self.watched = False  # a watch follows the run (set at each flush)
        self.watch_gap_s = WATCHED_FLUSH_S  # while watched: the least time between flushes
        self.step_ns = 0.0  # the step time, smoothed (:meth:`stepped`)

    # -- counting -------------------------------------------------------------------------
    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Count the calling thread's CPU time in the block as ``name`` (a background
        thread's round of work)."""
        t0 = time.thread_time_ns()
        try:
            yield
        finally:
            spent = time.thread_time_ns() - t0
            with self._lock:
                self._ns[name] += spent

    def started(self) -> None:
        """Attach is done: the budget judges what the tracer takes from here on."""
        self._seen_proc = time.process_time_ns()
        self._seen_own = self.own_ns()

    def add(self, name: str, ns: int) -> None:
        """Count ``ns`` of CPU time measured elsewhere as part ``name``."""
        with self._lock:
            self._ns[name] += ns

    def own_ns(self) -> int:
        """The tracer's CPU time so far, every part together."""
        with self._lock:
            return self.capture_ns + sum(self._ns.values())

    def by_part(self) -> dict[str, int]:
        """The tracer's CPU time so far per part (ns)."""
        with self._lock:
            return {"capture": self.capture_ns, **self._ns}

    # -- the budget -----------------------------------------------------------------------
    @property
    def flush_every_steps(self) -> int:
        """The flush interval in steps now: the configured one times ``widen``; every step
        while watched (then at most every :attr:`flush_gap_ns`)."""
        return 1 if self.watched else self.base_steps * self.widen

    @property
    def flush_gap_ns(self) -> int:
        """The least time between two flushes while watched (``watch_gap_s``; :meth:`watched_due`),
        else none (the interval in steps rules)."""
        return int(self.watch_gap_s * 1e9) if self.watched else 0

    def stepped(self, ns: int) -> None:
        """A step took ``ns``: the smoothed step time that spaces the watched flushes."""
        if ns > 0:
            self.step_ns = float(ns) if self.step_ns <= 0 else 0.8 * self.step_ns + 0.2 * ns

    def watched_due(self, n: int) -> bool:
        """While watched: whether step ``n`` begins with a flush. Every ``k`` steps, ``k`` the
        least power of two whose steps span ``watch_gap_s`` (1 where a step is longer), at the
        steps that are multiples of ``k``: every rank flushes the same steps (a rank whose
        smoothed step reads a little longer picks ``k`` or half of it, whose multiples hold
        ``k``'s), so a watch reads each as soon as the slowest rank wrote it, instead of
        waiting for each rank's own gap to pass."""
        k = 1
        while k * self.step_ns < self.flush_gap_ns and k < MAX_WATCH_STEPS:
            k *= 2
        return n % k == 0

    @property
    def flush_every_s(self) -> float:
        """The flush interval in seconds now: the configured one times ``widen``."""
        return self.base_s * self.widen

    def limit_rows(self, rows_per_step: float, max_rows: int) -> None:
        """Cap the widening so that one interval's rows of a table stay under half of
        ``max_rows`` (so that widening never drops a row)."""
        if rows_per_step <= 0:
            return
        fit = int(max_rows / 2 / (rows_per_step * self.base_steps))
        self.max_widen = max(1, min(MAX_WIDEN, fit))
        if self.widen > self.max_widen:
            self.widen = self.max_widen

    def watch(self, on: bool) -> bool:
        """Whether a watch follows the run now (its marker, read at each flush): on, the
        interval is the configured one and a step asks for a flush at each step, at most every
        :data:`WATCHED_FLUSH_S` to begin with; off, the configured interval again. Returns
        whether that changed."""
        if on == self.watched:
            return False
        self.watched = on
        self.watch_gap_s = WATCHED_FLUSH_S
        if on:
            self.widen = 1
        return True

    def review(self, watched: bool = False) -> bool:
        """At a flush: the tracer's share of the process's CPU since the last review, and the
        interval it allows. A run watched live (``megascope watch``) keeps the configured
        interval and flushes at each step (``flush_every_steps`` 1), at most every
        ``watch_gap_s``, which the flushes' own share widens and narrows instead, against
        :data:`WATCHED_BUDGET_TIMES` the budget (up to :data:`WATCHED_MAX_S`). Returns whether
        the interval changed."""
        before_steps = self.flush_every_steps
        self.watch(watched)
        proc = time.process_time_ns()
        by = self.by_part()
        own = sum(by.values())
        d_proc, d_own = proc - self._seen_proc, own - self._seen_own
        if d_proc < MIN_REVIEW_NS:
            return self.flush_every_steps != before_steps
        flushing = by["flush"] - self._seen_flush
        self._seen_proc, self._seen_own, self._seen_flush = proc, own, by["flush"]
        share = d_own / d_proc
        self._peak = max(self._peak, share)
        if watched:  # only the flushes' cost answers to their cadence
            allowed = self.share * WATCHED_BUDGET_TIMES
            if flushing / d_proc > allowed:
                self.watch_gap_s = min(WATCHED_MAX_S, self.watch_gap_s * 2)
            elif flushing / d_proc < allowed * NARROW_BELOW:
                self.watch_gap_s = max(WATCHED_FLUSH_S, self.watch_gap_s / 2)
            return self.flush_every_steps != before_steps
        before = self.widen
        if share > self.share and flushing > 0:
            if self.widen < self.max_widen:
                self.widen = min(self.max_widen, self.widen * 2)
                self.widenings += 1
            elif not self._warned:
                self._warned = True
                log.warning(
                    "megascope: the tracer took %.1f%% of this rank's CPU (budget %.1f%%) at its "
                    "widest flush interval (%d steps)",
                    100 * share,
                    100 * self.share,
                    self.flush_every_steps,
                )
        elif share < self.share * NARROW_BELOW and self.widen > 1:
            self.widen //= 2
        return self.widen != before or self.flush_every_steps != before_steps

    def summary(self, steps: int) -> dict[str, Any]:
        """run.json's ``tracer_cpu`` entry of this rank, after ``steps`` steps."""
        by = self.by_part()
        own = sum(by.values())
        steady = own - by["start"] - by["close"]
        proc = max(1, time.process_time_ns() - self._proc0)
        return {
            "cpu_s": round(own / 1e9, 4),
            "process_cpu_s": round(proc / 1e9, 3),
            "share": round(own / proc, 5),
            "steady_share": round(steady / proc, 5),
            "ms_per_step": round(steady / 1e6 / steps, 4) if steps else None,
            "by_part": {k: round(v / 1e9, 4) for k, v in by.items()},
            "budget": self.share,
            "flush_every_steps": self.flush_every_steps,
            "widenings": self.widenings,
            "peak_share": round(self._peak, 5),
        }
