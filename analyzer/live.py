"""Looks at a running run (``megascope watch``, the dashboard's live mode): the detectors over
its newest complete steps (a full look), the numbers a Prometheus scrape shows, and pulses
between full looks that read only the new steps' digests (analyzer/pulse.py). The command that
prints and announces what these find is analyzer/commands/watch.py.

A full look costs about a second of CPU at a few ranks (ten at 12,288): taken at each new step,
it would hold a watch seconds behind a run of short steps, and take that CPU from ranks that
share its cores. So the pulse follows every step, and names at once a rank that turned slow
(:func:`analyzer.findings.onset.turned`, over the digests' own work less the wait for a core:
the straggler's onset test, which needs three slow steps); a full look follows it straight
away, and otherwise comes at most every :data:`FULL_SHARE_INV` times what the last one took
(every :data:`FULL_EVERY` seconds past 1,024 ranks), when the pulse's screen names a rank it did
not name, and when the run ends. The full look is the verdict: a rank named early that it does
not name is taken back (its ``-`` line) and not named early again. A watch runs its full looks
in a process of its own (``Looks(background=True)``), so that a full look under way never holds
back the pulse; the run's last look is taken at once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from analyzer.findings import FINDING_KINDS
from tracer.schema import RUN_STATUSES

if TYPE_CHECKING:
    from analyzer.db import Run
    from analyzer.findings.onset import Turn
    from analyzer.findings.record import Finding
    from analyzer.pulse import Beat

log = logging.getLogger(__name__)
ENDED = tuple(s for s in RUN_STATUSES if s != "running")
WINDOW = 20  # newest complete steps analyzed (--window); the dashboard's live mode too
FULL_EVERY = 60.0  # seconds between full looks past EXACT_MAX_RANKS ranks (--full-every)
# up to EXACT_MAX_RANKS ranks, a full look comes this many times what the last one took after
# it (at each new step where that is shorter): the watch spends a fifth of its time in full
# looks at most, and the pulse follows every step between them
FULL_SHARE_INV = 5
BACKGROUND_NICE = 10  # the niceness of a watch's process of full looks (Looks(background=True))
# seconds between a watch's checks for a newly complete step (up to EXACT_MAX_RANKS ranks): a
# listing of the digests files, read where every rank behind the newest complete step wrote
# again (Looks.wait, analyzer/pulse.py)
TICK = 0.05
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
    full: bool = True  # the detectors' look; else a pulse's (the findings those that stand)


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


def _pool() -> ProcessPoolExecutor:
    """One process for full looks, started afresh (spawn: no state of this one copied), at a
    lower priority (:data:`BACKGROUND_NICE`)."""
    return ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"), initializer=_lower_priority
    )


def _lower_priority() -> None:
    """The full looks' process yields the cores to the pulse and to the ranks it watches."""
    with contextlib.suppress(OSError):
        os.nice(BACKGROUND_NICE)


def warm() -> None:
    """What a full look imports, imported (a background process's first task)."""
    import analyzer.db
    import analyzer.findings  # noqa: F401


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


def taken_back(
    early: dict[tuple[str, tuple[int, ...]], Finding], seen: Look
) -> set[tuple[str, tuple[int, ...]]]:
    """Of the findings named early (by their key), those the full look ``seen`` does not name,
    though it read the newest step they were named from."""
    named = {finding_key(f) for f in seen.findings}
    newest = seen.steps[1] if seen.steps is not None else None
    return {
        k
        for k, f in early.items()
        if k not in named and newest is not None and newest >= f["steps"][1]
    }


def early_finding(turn: Turn, mesh: dict[str, int], hi: int) -> Finding:
    """The straggler finding of a rank the pulse saw turn slow (:class:`Turn`), named before a
    full look reads its steps: from its onset to ``hi``, its severity its excess over its
    peers' as a share of the step, no host (the full look's record replaces it)."""
    from tracer.rundir import coords_of

    message = (
        f"rank {turn.rank} turned slow at step {turn.at}: its own work {turn.factor:.2f}x its "
        f"peers' in the {turn.steps} steps since (from the step digests; the full look follows)"
    )
    evidence = {"signal": "own_time", "factor": round(turn.factor, 4), "onset_step": turn.at,
                "shift_z": round(turn.z, 2), "early": True}  # fmt: skip
    return {
        "kind": "straggler",
        "ranks": [turn.rank],
        "coords": [coords_of(turn.rank, mesh)],
        "hosts": [None],
        "severity": round(min(max(turn.share, 0.0), 1.0), 4),
        "steps": [turn.at, hi],
        "evidence": evidence,
        "message": message,
    }


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
                 full_every: float | None = None, background: bool = False) -> None:  # fmt: skip
        from analyzer.pulse import Pulse

        self.run, self.window, self.whatif, self.once = run, window, whatif, once
        self.full_every = full_every
        self.pulse = Pulse(run)
        self.last_full: float | None = None
        self.screened: frozenset[int] = frozenset()  # the screen's ranks a full look has seen
        self.read_to: int | None = None  # the newest step the last look read, or its pulse saw
        self.looked = 0.0  # when the last look ended (time.monotonic)
        self.early: dict[tuple[str, tuple[int, ...]], Finding] = {}  # named early, unconfirmed
        self.refuted: set[tuple[str, tuple[int, ...]]] = set()  # ... and a full look did not
        self.full_due = False  # a full look is due at once (a rank named early)
        self.full_took = 0.0  # seconds the last full look took
        # with ``background``, full looks run in a process of their own while the pulse goes on
        # (:meth:`_submit`): the one in flight, and when it began
        self.background = background
        self.pool: ProcessPoolExecutor | None = None
        self.pending: Future[Look | None] | None = None
        self.pending_at = 0.0
        self.pending_screen: frozenset[int] = frozenset()
        if background and not once:  # its imports now, not at the run's first full look
            self.pool = _pool()
            self.pool.submit(warm)

    def next(self, active: list[Finding]) -> Look | None:
        """The next look: a full one when due (the module docstring), else one from the pulse's
        digests; None while nothing is readable. Before a full look, a rank the pulse saw turn
        slow (:meth:`_early`) is named at once, from the digests; the full look follows at the
        next call, and a rank it does not name is taken back (:meth:`judge`). Records the
        newest step read, for :meth:`wait`."""
        now = time.monotonic()
        beat = self.pulse.look(self.window)
        seen = self._early(beat, active)
        if seen is None:
            seen = self._landed(now)
        if seen is None:
            seen = self._next(active, now, beat)
        if seen is not None and seen.steps is not None and seen.full:
            seen = self.judge(seen)
        ends = [s for s in (self.pulse.frontier, seen.steps[1] if seen and seen.steps else None)
                if s is not None]  # fmt: skip
        self.read_to = max(ends) if ends else None
        self.looked = time.monotonic()
        return seen

    def _next(self, active: list[Finding], now: float, beat: Beat | None) -> Look | None:
        from analyzer.duck import EXACT_MAX_RANKS

        small = beat is None or beat.world <= EXACT_MAX_RANKS
        every = self.full_every
        if every is None:
            every = FULL_SHARE_INV * self.full_took if small else FULL_EVERY
        if beat is not None and beat.steps is None and beat.status not in ENDED and not self.once:
            # fewer steps than a window past the warm-up: a full look would analyze nothing
            return Look(beat.status, None, active, beat.step_s, beat.compute_s, False)
        full = (
            beat is None
            or self.last_full is None
            or now - self.last_full >= every
            or beat.status in ENDED
            or self.once
            or self.full_due
            or bool(beat.suspects - self.screened)
        )
        at_once = beat is None or beat.status in ENDED or self.once  # a window past here
        if full and self.background and not at_once:
            assert beat is not None
            full = self.pending is None and not self._submit(now, beat.suspects)
        if not full:
            assert beat is not None  # no beat means a full look
            self.screened &= beat.suspects
            return Look(beat.status, beat.steps, active, beat.step_s, beat.compute_s, False)
        self.full_due = False
        if self.pending is not None:  # the run ended, say: its last look is this one
            self.pending.cancel()
            self.pending = None
        seen = look(self.run, self.window, self.whatif)
        if seen is not None:
            self.last_full = now
            self.full_took = time.monotonic() - now
            self.screened = beat.suspects if beat is not None else frozenset()
        return seen

    def _submit(self, now: float, suspects: frozenset[int]) -> bool:
        """Start a full look in the background process (made anew where it is gone); False,
        with full looks taken in this process from then on, where none can be started."""
        try:
            if self.pool is None:
                self.pool = _pool()
            self.pending = self.pool.submit(look, self.run, self.window, self.whatif)
        except (BrokenProcessPool, RuntimeError, OSError) as exc:
            log.warning("megascope watch: full looks in this process from now on (%s)", exc)
            self.background, self.pool = False, None
            return False
        self.full_due = False
        self.pending_at, self.pending_screen = now, suspects
        return True

    def _landed(self, now: float) -> Look | None:
        """The full look run in the background, once it is done (None before, and where it
        read nothing or failed: the next one is due at once)."""
        if self.pending is None or not self.pending.done():
            return None
        done, self.pending = self.pending, None
        try:
            seen = done.result()
        except Exception as exc:  # a worker that died: the next full look starts another
            log.warning("megascope watch: a full look failed (%s)", exc)
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
            return None
        if seen is not None:
            self.last_full = self.pending_at
            self.full_took = now - self.pending_at
            self.screened = self.pending_screen
        return seen

    def _early(self, beat: Beat | None, active: list[Finding]) -> Look | None:
        """A look that adds the stragglers the pulse saw turn slow (``Beat.turns``) and no
        finding names yet; None where there are none. A full look follows at once
        (:meth:`wait`)."""
        if beat is None or beat.steps is None or beat.status in ENDED or self.once:
            return None
        named = {finding_key(f) for f in active}
        new = [
            early_finding(t, self.pulse.mesh, beat.steps[1])
            for t in beat.turns
            if ("straggler", (t.rank,)) not in named | self.refuted
        ]
        if not new:
            return None
        self.early.update((finding_key(f), f) for f in new)
        self.full_due = True
        return Look(beat.status, beat.steps, [*active, *new], beat.step_s, beat.compute_s, False)

    def judge(self, seen: Look) -> Look:
        """After a full look: the ranks named early that it names too are its own now; one it
        does not name, once it read the steps they were named from, is taken back for good
        (its ``-`` line comes from the watch: the full look is the verdict). One it has not
        read that far (a look begun before it) stands, with the look's findings; the look's
        transient stall of its rank at its onset is its first steps, and goes
        (:func:`analyzer.findings.onset.first_steps`)."""
        from analyzer.findings.onset import first_steps

        back = taken_back(self.early, seen)
        named = {finding_key(f) for f in seen.findings}
        self.refuted |= back
        self.early = {k: f for k, f in self.early.items() if k not in back | named}
        if not self.early:
            return seen
        standing = list(self.early.values())
        kept = [f for f in seen.findings if not first_steps(f, standing)]
        return replace(seen, findings=[*kept, *standing])

    def wait(self, interval: float) -> None:
        """Sleep until the next look is due: as soon as every rank has written a step the last
        look did not read, or the run's status changed; ``interval`` seconds after the last
        look ended at the latest (a hung run writes no step). The new step is seen from the
        pulse, every :data:`TICK` seconds (or five times what listing the digests files took,
        where that is longer), up to ``EXACT_MAX_RANKS`` ranks on a run with stored digests;
        elsewhere a look comes every ``interval``; at once after a look that named a rank
        early (its full look). A step reaches the files when the tracers flush (every 10 steps
        or 5 s by default; ``MEGASCOPE_FLUSH_STEPS``), and while a watch's marker is fresh
        (:class:`WatchMarker`) at each step, at most every 0.5 s: so a watch looks once a
        flush, and reads each step soon after every rank closed it."""
        from analyzer.duck import EXACT_MAX_RANKS

        if self.full_due:  # a rank named from the digests: its full look now
            return
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
            if new or self.pulse.status != status or (self.pending and self.pending.done()):
                return

    def close(self) -> None:
        """Close the pulse's connection, and the background process (a look in flight ends
        on its own)."""
        self.pulse.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
