"""Looks at a running run (``megascope watch``, the dashboard's live mode): the detectors over
its newest complete steps, the numbers a Prometheus scrape shows, and, past 1,024 ranks, pulses
between full looks that read only the new steps' digests (analyzer/pulse.py). The command that
prints and announces what these find is analyzer/commands/watch.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from analyzer.findings import FINDING_KINDS
from tracer.schema import RUN_STATUSES

if TYPE_CHECKING:
    from analyzer.db import Run
    from analyzer.findings.record import Finding
    from analyzer.pulse import Beat

ENDED = tuple(s for s in RUN_STATUSES if s != "running")
WINDOW = 20  # newest complete steps analyzed (--window); the dashboard's live mode too
FULL_EVERY = 60.0  # seconds between full looks past EXACT_MAX_RANKS ranks (--full-every)
# seconds between a watch's checks for a newly complete step (up to EXACT_MAX_RANKS ranks): a
# listing of the digests files, read where one is new (Looks.wait)
TICK = 0.1
CHECK_SHARE_INV = 5  # or 5 times what a listing took (a fifth of a core at most)


class WatchMarker:
    """A watch's marker in the run directory (tracer/rundir.py), touched every
    ``WATCH_BEAT_S`` from a thread of its own, so that a look that takes long leaves it fresh:
    while it is fresh the run's tracers write each step as it ends. :meth:`stop` removes it
    (a watch killed outright leaves it to go stale in ``WATCHED_S``)."""

    def __init__(self, run_dir: str) -> None:
        from tracer.rundir import WATCH_BEAT_S

        self.run_dir = run_dir
        self.every = WATCH_BEAT_S
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="megascope-watch-marker", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        from tracer.rundir import mark_watched

        while not self._stop.is_set():
            mark_watched(self.run_dir)
            self._stop.wait(self.every)

    def stop(self) -> None:
        """Stop touching the marker, and remove it where it is this process's."""
        from tracer.rundir import unmark_watched

        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        unmark_watched(self.run_dir)


def finding_key(f: Finding) -> tuple[str, tuple[int, ...]]:
    """What makes a finding the same one from look to look: its kind and ranks."""
    return f["kind"], tuple(f["ranks"])


@dataclass
class Look:
    """One look at the run: its status, the steps analyzed, the findings, the numbers."""

    status: str
    steps: tuple[int, int] | None = None
    findings: list[Finding] = field(default_factory=list)
    step_s: float | None = None
    compute_s: dict[int, float] = field(default_factory=dict)


def look(run_dir: str, window: int, whatif: bool) -> Look | None:
    """The run's newest ``window`` complete steps analyzed (nothing until there are that many
    past the warm-up); None while nothing is readable, or when the tracer merged files away
    while they were being read (the next look reads the merged ones)."""
    import duckdb

    from analyzer.db import RunError, open_run
    from tracer.rundir import read_run_json

    try:
        status = str(read_run_json(run_dir).get("status", "running"))
        run = open_run(run_dir)
    except (RunError, ValueError, OSError, duckdb.Error):
        return None
    try:
        return _analyze(run, status, window, whatif)
    except (RunError, OSError, duckdb.Error):
        return None
    finally:
        run.close()


def live_steps(run: Run, window: int) -> tuple[int, int] | None:
    """The newest ``window`` complete steps past the warm-up, or None while there are fewer:
    what a look analyzes (the dashboard's live mode reads the same). While the run trains, a
    step is complete once every rank has written all of it
    (:func:`analyzer.findings.live_last_step`)."""
    from analyzer.findings import step_window

    lo, hi = step_window(run, None, live=True)
    return (hi - window + 1, hi) if hi - lo + 1 >= window else None


def _analyze(run: Run, status: str, window: int, whatif: bool) -> Look:
    from analyzer.duck import EXACT_MAX_RANKS
    from analyzer.findings import analyze

    steps = live_steps(run, window)
    if steps is None:
        return Look(status)
    report = analyze(run, steps=steps, whatif=whatif)
    exact = run.world_size <= EXACT_MAX_RANKS  # else from the digests, not every raw row
    name = "findings/rank_compute" if exact else "findings/rank_compute_digest"
    per_rank = run.query(name, lo=steps[0], hi=steps[1])
    med = report["run"].get("median_step_ms")
    return Look(
        status,
        steps,
        report["findings"],
        med / 1e3 if med is not None else None,
        {int(r): float(s) for r, s in zip(per_rank["rank"], per_rank["s"], strict=True)},
    )


class Metrics:
    """The Prometheus series, served from a thread of prometheus-client."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.step = Gauge("megascope_step_seconds", "median step time in the window",
                          registry=self.registry)  # fmt: skip
        self.last = Gauge("megascope_last_step", "newest complete step", registry=self.registry)
        self.compute = Gauge("megascope_rank_compute_seconds", "median compute per step",
                             ["rank"], registry=self.registry)  # fmt: skip
        self.findings = Gauge("megascope_findings", "active findings", ["kind"],
                              registry=self.registry)  # fmt: skip
        self.mfu = Gauge("megascope_mfu", "model FLOPs utilization (run.json)",
                         registry=self.registry)  # fmt: skip
        for kind in FINDING_KINDS:
            self.findings.labels(kind=kind).set(0)
        start_http_server(port, addr=host, registry=self.registry)

    def update(self, seen: Look, mfu: float | None) -> None:
        """Set the series from a look: newest step, step time, each rank's compute, active findings
        per kind and, when known, the MFU."""
        if seen.steps is not None:
            self.last.set(seen.steps[1])
        if seen.step_s is not None:
            self.step.set(seen.step_s)
        for rank, s in seen.compute_s.items():
            self.compute.labels(rank=str(rank)).set(s)
        counts = {kind: 0 for kind in FINDING_KINDS}
        for f in seen.findings:
            counts[f["kind"]] = counts.get(f["kind"], 0) + 1
        for kind, n in counts.items():
            self.findings.labels(kind=kind).set(n)
        if mfu is not None:
            self.mfu.set(mfu)


class Looks:
    """Full looks, and pulses in between where the run has digests and is large (see the
    module docstring)."""

    def __init__(self, run: str, window: int, *, whatif: bool = True, once: bool = False,
                 full_every: float | None = None) -> None:  # fmt: skip
        from analyzer.pulse import Pulse

        self.run, self.window, self.whatif, self.once = run, window, whatif, once
        self.full_every = full_every
        self.pulse = Pulse(run)
        self.last_full: float | None = None
        self.screened: frozenset[int] = frozenset()  # the screen's ranks a full look has seen
        self.read_to: int | None = None  # the newest step the last look read, or its pulse saw
        self.looked = 0.0  # when the last look ended (time.monotonic)

    def next(self, active: list[Finding]) -> Look | None:
        """The next look: a full one when due (the module docstring), else one from the pulse's
        digests; None while nothing is readable. Records the newest step read, for :meth:`wait`."""
        now = time.monotonic()
        beat = self.pulse.look(self.window)
        seen = self._next(active, now, beat)
        ends = [s for s in (self.pulse.frontier, seen.steps[1] if seen and seen.steps else None)
                if s is not None]  # fmt: skip
        self.read_to = max(ends) if ends else None
        self.looked = time.monotonic()
        return seen

    def _next(self, active: list[Finding], now: float, beat: Beat | None) -> Look | None:
        from analyzer.duck import EXACT_MAX_RANKS

        every = self.full_every
        if every is None:
            every = 0.0 if beat is None or beat.world <= EXACT_MAX_RANKS else FULL_EVERY
        full = (
            beat is None
            or beat.steps is None
            or self.last_full is None
            or now - self.last_full >= every
            or beat.status in ENDED
            or self.once
            or bool(beat.suspects - self.screened)
        )
        if not full:
            assert beat is not None  # no beat means a full look
            self.screened &= beat.suspects
            return Look(beat.status, beat.steps, active, beat.step_s, beat.compute_s)
        seen = look(self.run, self.window, self.whatif)
        if seen is not None:
            self.last_full = now
            self.screened = beat.suspects if beat is not None else frozenset()
        return seen

    def wait(self, interval: float) -> None:
        """Sleep until the next look is due: as soon as every rank has written a step the last
        look did not read, or the run's status changed; ``interval`` seconds after the last
        look ended at the latest (a hung run writes no step). The new step is seen from the
        pulse, every :data:`TICK` seconds (or five times what listing the digests files took,
        where that is longer), up to ``EXACT_MAX_RANKS`` ranks on a run with stored digests;
        elsewhere a look comes every ``interval``. A step reaches the files when the
        tracers flush (every 10 steps or 5 s by default; ``MEGASCOPE_FLUSH_STEPS``), and while
        a watch's marker is fresh (:class:`WatchMarker`) at each step, at most every 0.5 s: so a
        watch looks once a flush, and reads each step soon after every rank closed it."""
        from analyzer.duck import EXACT_MAX_RANKS

        due = self.looked + interval
        status = self.pulse.status
        tick = TICK
        while (now := time.monotonic()) < due:
            if self.pulse.world > EXACT_MAX_RANKS or interval <= TICK:
                time.sleep(due - now)
                return
            time.sleep(min(tick, due - now))
            began = time.monotonic()
            beat = self.pulse.look(self.window)
            if beat is None:  # no digests: every interval
                continue
            if not beat.read_steps:  # a listing alone: what the checks cost while nothing comes
                tick = max(TICK, CHECK_SHARE_INV * (time.monotonic() - began))
            new = self.pulse.frontier is not None and (
                self.read_to is None or self.pulse.frontier > self.read_to
            )
            if new or self.pulse.status != status:
                return

    def close(self) -> None:
        """Close the pulse's connection."""
        self.pulse.close()
