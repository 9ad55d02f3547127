"""The per-rank tracer object: buffers, flushing, failures, hangs.

A :class:`Tracer` is built by :func:`tracer.api.attach` and owns everything of one rank: the row
buffers (see tracer.writer), the collective recorder (tracer.collectives), the CUDA timer, the
clock offset, the flusher, watchdog and NVML threads. Every entry point from the training is
guarded: the first failure turns the whole tracer off with one warning (:meth:`fail`), and a
failed write (disk full, permissions) does the same, so training always goes on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tracer import rundir
from tracer.budget import Budget, collector_paused
from tracer.clock import (
    CpuMark,
    CudaTimer,
    clock_peers,
    cpu_mark,
    estimate_offsets,
    now_ns,
    thread_since,
)
from tracer.config import TracerConfig
from tracer.digest import flush_digests
from tracer.flight import StepClock
from tracer.hwclass import HwClass
from tracer.parts import AutoPart, GroupsPart, RecorderPart, Stoppable
from tracer.schema import DERIVED_TABLES, TABLES, C, W
from tracer.writer import Buffer, Flusher, PartWriter, to_columns

if TYPE_CHECKING:
    from tracer.beacon import StorageFailure

log = logging.getLogger(__name__)

# Where a buffered row holds its group's name, for the tables whose rows name one.
_GROUP_COLUMN = {"collectives": C.group, "work": W.group}


class Tracer:
    """One rank's tracer. Use :func:`tracer.attach`, not the constructor."""

    def __init__(
        self,
        run_dir: str,
        *,
        rank: int,
        world: int,
        local_rank: int,
        mesh: Mapping[str, int],
        config: TracerConfig,
    ) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.world = world
        self.local_rank = local_rank
        self.mesh = {k: int(mesh.get(k, 1)) for k in ("dp", "pp", "tp", "cp")}
        self.config = config
        self.step_no = -1
        self.mb = -1
        self.enabled = True
        self.writing = True
        self.closed = False
        self.hung = False  # on_hang ran: a later error is the hang's consequence
        self.owns_run_json = False
        self.storage_failure: StorageFailure | None = None  # once writing failed
        self.device = "cpu"
        self.gpu_uuid: str | None = None
        self.hw = HwClass()  # filled at attach (tracer.lifecycle)
        self.timer: CudaTimer | None = None
        self.recorder: RecorderPart | None = None
        self.offset_ns = 0
        self.buffers = {t: Buffer(config.max_rows) for t in TABLES if t not in DERIVED_TABLES}
        self.digesting = True  # writes the digests of each flush (tracer/digest.py)
        self.writer = PartWriter(run_dir, rank)
        # the tracer's own CPU time, and the flush interval it allows (tracer/budget.py)
        self.budget = Budget(config.cpu_budget, config.flush_every_steps, config.flush_every_s)
        self.steps_seen = 0
        self._step_start: int | None = None
        self._step_cpu: CpuMark | None = None  # the training thread's CPU time at its start
        self._last_flush_step = 0
        self._flushed_steps = 0  # steps_seen at the last flush
        self._last_progress: float | None = None  # armed by the first step or collective
        self.beats = 0  # progress so far (see progress)
        self._beats_seen = 0
        self._warned = False
        self._drops_reported = False
        self._flush_lock = threading.Lock()
        self._deferred: dict[str, list[tuple[Any, ...]]] = {}
        self._clock_pg: Any = None
        self._clock_peers: list[int] = []
        self._clock_thread: threading.Thread | None = None
        self.flusher: Flusher | None = None
        self.watchdog: Stoppable | None = None
        self.sampler: Stoppable | None = None
        self.auto: AutoPart | None = None  # steps and spans of a plain script
        self.groups: GroupsPart | None = None  # the mesh and groups a script creates
        self.coords: dict[str, int] | None = None  # from a DeviceMesh, when one was seen
        self.step_clock = StepClock()
        self.restore: list[Callable[[], object]] = []  # undo the patches of torch made at attach
        self.after_hang: Callable[[], None] | None = None  # set by tracer.api (exit_on_hang)

    # -- failures ---------------------------------------------------------------------------
    def fail(self, exc: BaseException, what: str = "tracing") -> None:
        """Turn tracing off for good, with one warning; training goes on."""
        self.enabled = False
        if self.recorder is not None:
            self.recorder.active = False
        if not self._warned:
            self._warned = True
            log.warning(
                "megascope: %s failed on rank %d (%s: %s); tracing is off for the rest of the run",
                what,
                self.rank,
                exc.__class__.__name__,
                exc,
            )

    def fail_writing(self, exc: BaseException, path: str) -> None:
        """A write into the run directory failed: writing stops for good (the rows go on being
        drained and dropped), with one line naming the path and the error (an OSError: disk
        full, read-only, permissions, an I/O error, a vanished folder); the launcher, when one
        listens, hears of it (tracer/beacon.py). Tracing of anything else stops too."""
        self.writing = False
        if not isinstance(exc, OSError):
            self.fail(exc, f"writing to {path}")
            return
        from tracer import beacon

        failure = beacon.StorageFailure(
            self.rank, "tracer", beacon.failed_path(exc, path), beacon.describe(exc), self.step_no
        )
        self.storage_failure = failure
        self.enabled = False
        if self.recorder is not None:
            self.recorder.active = False
        if not self._warned:
            self._warned = True
            log.warning("%s", beacon.off_line(failure))
            beacon.sender().failure(failure)

    def progress(self) -> None:
        """A step began, a collective was issued or completed: a count, no clock read (the hot
        path's cost); :meth:`last_progress` dates the count's changes."""
        self.beats += 1

    def last_progress(self) -> float | None:
        """monotonic() when the watchdog, which calls this at every look, first saw the last
        progress (a step, a collective issued or completed); None before the first one
        (start-up, however long, is not a hang)."""
        beats = self.beats
        if beats != self._beats_seen:
            self._beats_seen = beats
            self._last_progress = time.monotonic()
        return self._last_progress

    # -- steps and stamps -------------------------------------------------------------------
    def stamp(self, cuda: bool) -> Any:
        """A timestamp: a CUDA event on the current stream when ``cuda``, else host ns."""
        if cuda and self.timer is not None:
            ev = self.timer.record()
            if ev is not None:
                return ev
        return now_ns()

    def step(self, n: int, start_ns: int | None = None) -> None:
        """Step ``n`` begins (at ``start_ns``, default now): close the previous step span,
        heartbeat, flush and clock policy."""
        t0 = time.perf_counter_ns()
        now = now_ns()
        begin = now if start_ns is None else min(start_ns, now)
        if self._step_start is not None:
            self.budget.stepped(begin - self._step_start)
            self.buffers["spans"].add(
                (
                    self.step_no,
                    -1,
                    "step",
                    "host",
                    self._step_start,
                    begin,
                    "host",
                    *thread_since(self._step_cpu),
                )
            )
        self.step_no = n
        self._step_start = begin
        self._step_cpu = cpu_mark()
        self.step_clock.begin(begin, n)
        self.steps_seen += 1
        self.buffers["heartbeats"].add((now, n, "step"))
        self.beats += 1
        flight = self.recorder.flight if self.recorder is not None else None
        budget = self.budget
        due = (
            budget.watched_due(n)
            if budget.watched
            else abs(n - self._last_flush_step) >= budget.flush_every_steps
        )
        if due or (flight is not None and flight.active and flight.backlog()):
            self._last_flush_step = n
            if self.flusher is not None:
                self.flusher.request()
        every = self.config.clock_every_steps
        if every > 0 and n > 0 and n % every == 0:
            self._reestimate_clock()
        self.budget.capture_ns += time.perf_counter_ns() - t0

    def end_step(self) -> None:
        """Close the open step span (at close)."""
        if self._step_start is not None:
            self.buffers["spans"].add(
                (self.step_no, -1, "step", "host", self._step_start, now_ns(), "host",
                 *thread_since(self._step_cpu))
            )  # fmt: skip
            self._step_start = None

    # -- clock ------------------------------------------------------------------------------
    def sync_clock(self, pg: Any) -> None:
        """First offset estimate (at attach, on every rank at once)."""
        self._clock_peers = clock_peers(pg, self.world, self.config.clock_same_host)
        self._clock_pg = pg if self._clock_peers else None
        self.offset_ns = estimate_offsets(
            pg, self.rank, self._clock_peers, self.config.clock_rounds
        )

    def _reestimate_clock(self) -> None:
        """Re-estimate on a background thread over the side group; a new topology row."""
        if self._clock_pg is None or (self._clock_thread and self._clock_thread.is_alive()):
            return

        def run() -> None:
            try:
                with self.budget.part("clock"):
                    self.offset_ns = estimate_offsets(
                        self._clock_pg, self.rank, self._clock_peers, self.config.clock_rounds
                    )
                    self.buffers["topology"].add(self.topology_row())
            except Exception as exc:  # a peer gone: stop re-estimating, keep tracing
                log.info("megascope: clock re-estimate stopped (%s)", exc)
                self._clock_pg = None

        self._clock_thread = threading.Thread(target=run, name="megascope-clock", daemon=True)
        self._clock_thread.start()

    def join_clock(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a clock re-estimate under way (at close)."""
        thread = self._clock_thread
        if thread is not None:
            thread.join(timeout)

    def topology_row(self) -> tuple[Any, ...]:
        """This rank's ``topology`` row: host, local rank, pid, device, GPU uuid, mesh coordinates,
        clock offset and the hardware columns."""
        import socket

        from tracer.rundir import coords_of

        c = self.coords or coords_of(self.rank, self.mesh)
        return (socket.gethostname(), self.local_rank, os.getpid(), self.device, self.gpu_uuid,
                c["dp"], c["pp"], c["tp"], c["cp"], self.offset_ns, *self.hw.row())  # fmt: skip

    # -- writing ----------------------------------------------------------------------------
    def flush(
        self, *, final: bool = False, extra: Mapping[str, list[tuple[Any, ...]]] | None = None
    ) -> None:
        """Write every buffer's rows as one part per table (the flusher thread calls this).

        Rows whose CUDA events have not completed wait for the next flush, except when
        ``final`` (close, hang): then events get 2 s in all, and what is still pending is
        written as null. ``final`` also merges each table's parts into one file. The flush's
        CPU time is the tracer's own (part ``flush``), and each flush but the last reviews the
        tracer's CPU budget (tracer/budget.py), which may widen the flush interval.
        """
        with self.budget.part("close" if final else "flush"), collector_paused():
            self._flush(final, extra)
        if final:
            return
        watched = rundir.watched(self.run_dir)  # one stat a flush: a watch's marker
        was = self.budget.watched
        if self.config.cpu_budget > 0:
            changed = self.budget.review(watched=watched)
        else:
            changed = self.budget.watch(watched)
        if changed and watched != was:
            log.info(
                "megascope: rank %d %s",
                self.rank,
                "writes each step while a watch follows the run"
                if watched
                else f"flushes every {self.budget.flush_every_steps} steps again (no watch)",
            )
        elif changed:
            log.info(
                "megascope: rank %d flushes every %d steps (its CPU budget)",
                self.rank,
                self.budget.flush_every_steps,
            )

    def _flush(self, final: bool, extra: Mapping[str, list[tuple[Any, ...]]] | None) -> None:
        with self._flush_lock:
            if not self.writing:
                for buf in self.buffers.values():
                    buf.drain()
                return
            timer = self.timer
            resolve = None
            if timer is not None:
                try:
                    timer.recalibrate()
                except Exception as exc:
                    self.fail(exc, "CUDA timing")
                resolve = timer.settle(2.0) if final else timer.resolve
            extra = dict(extra or {})
            flight = self.recorder.flight if self.recorder is not None else None
            if flight is not None:
                try:
                    extra["collectives"] = list(extra.get("collectives", [])) + flight.read(final)
                except Exception as exc:
                    flight.active = False
                    log.warning("megascope: Flight Recorder reading stopped: %s", exc)
            if self.groups is not None:
                self.groups.write_meta()
            written: dict[str, Any] = {}
            most = 0
            for table, buf in self.buffers.items():
                rows = self._deferred.pop(table, []) + buf.drain() + list(extra.get(table, []))
                most = max(most, len(rows))
                if table in _GROUP_COLUMN and self.recorder is not None:
                    rows = self.recorder.rename_rows(rows, _GROUP_COLUMN[table])
                if not rows and not final:
                    continue
                try:
                    cols, deferred = to_columns(table, rows, self.rank, self.offset_ns, resolve)
                    if deferred:
                        self._deferred[table] = deferred
                    self.writer.write(table, cols)
                    written[table] = cols
                except Exception as exc:
                    self.fail_writing(exc, rundir.rank_dir(self.run_dir, table, self.rank))
                    return
            # the digests as soon as their rows are down, before the merges (a watch reads them)
            self._write_digests(written, final)
            for table in written:
                try:
                    self.writer.compact(table, 2 if final else self.config.compact_parts)
                except Exception as exc:
                    self.fail_writing(exc, rundir.rank_dir(self.run_dir, table, self.rank))
                    return
            self._report_drops()
            steps = self.steps_seen - self._flushed_steps
            if steps > 0:
                self._flushed_steps = self.steps_seen
                self.budget.limit_rows(most / steps, self.config.max_rows)

    def _write_digests(self, written: dict[str, Any], final: bool) -> None:
        """The digests of this flush's spans and collectives (docs/spec.md §2). A failure
        stops them, never the rows: the analyzer digests a run whose digests miss rows."""
        if not self.digesting:
            return
        try:
            rows = flush_digests(written.get("collectives"), written.get("spans"))
            if rows is not None:
                self.writer.write("digests", rows)
                self.writer.rows_written -= rows.num_rows  # rows traced, not derived
            self.writer.compact("digests", 2 if final else self.config.compact_parts)
        except Exception as exc:
            self.digesting = False
            log.warning("megascope: digests stopped (the analyzer makes them): %s", exc)

    def dropped(self) -> dict[str, int]:
        """Rows lost so far, by table (``flight_recorder_entries``: entries no wrapper saw that
        Flight Recorder's ring lost before a read)."""
        dropped = {t: b.dropped for t, b in self.buffers.items() if b.dropped}
        flight = self.recorder.flight if self.recorder is not None else None
        if flight is not None and flight.dropped:
            dropped["flight_recorder_entries"] = flight.dropped
        return dropped

    def record_drops(self) -> None:
        """At close: this rank's losses, if any, into run.json's ``dropped`` (by rank)."""
        dropped = self.dropped()
        if dropped:
            self._by_rank("dropped", dropped, "count the dropped rows")

    def record_cpu(self) -> None:
        """At close: this rank's own CPU time (tracer/budget.py) into run.json's
        ``tracer_cpu`` (by rank)."""
        self._by_rank("tracer_cpu", self.budget.summary(self.steps_seen), "write its CPU time")

    def _by_rank(self, key: str, value: Any, what: str) -> None:
        """run.json's ``key`` of this rank, under the run's lock, or where this node's disk has
        no run.json, ``.ranks/`` (docs/spec.md §1)."""
        if not self.writing:
            return
        try:
            rundir.record_for_rank(self.run_dir, self.rank, key, value)
        except (OSError, ValueError) as exc:
            log.info("megascope: could not %s in run.json: %s", what, exc)

    def _report_drops(self) -> None:
        dropped = self.dropped()
        if dropped and not self._drops_reported:
            self._drops_reported = True
            log.warning(
                "megascope: rank %d buffers full, rows dropped: %s (Flight Recorder's ring holds "
                "TORCH_FR_BUFFER_SIZE entries: raise it, or flush more often)",
                self.rank,
                dropped,
            )

    def flush_safely(self) -> None:
        """Flush; a failure turns tracing off (:meth:`fail`) instead of raising (the flusher
        thread's call)."""
        try:
            self.flush()
        except Exception as exc:
            self.fail(exc, "flushing")

    # -- hangs and stacks -------------------------------------------------------------------
    def take_stacks(self, reason: str) -> int:
        """Dump this process's threads into ``stacks``; returns the number of threads."""
        from tracer.watchdog import dump_own_stacks

        ts = now_ns()
        threads = dump_own_stacks()
        for thread, stack in threads:
            self.buffers["stacks"].add((ts, reason, thread, stack))
        return len(threads)

    def on_request(self) -> None:
        """Stacks were asked for (the trigger file or SIGUSR1): take them and flush."""
        self.take_stacks("request")
        self.flush()

    def on_hang(self, idle_s: float) -> None:
        """No progress for too long: state, the collectives in flight, stacks, flush."""
        log.warning(
            "megascope: rank %d made no progress for %.0f s (step %d); taking stacks",
            self.rank,
            idle_s,
            self.step_no,
        )
        self.hung = True
        self.buffers["heartbeats"].add((now_ns(), self.step_no, "hang"))
        self.take_stacks("hang")
        inflight = self.recorder.inflight_rows() if self.recorder is not None else []
        self.flush(final=True, extra={"collectives": inflight})
        self.record_drops()
        if self.owns_run_json:
            self.update_run_json(status="hung")
        if self.config.exit_on_hang and self.after_hang is not None:
            self.after_hang()

    # -- run.json ---------------------------------------------------------------------------
    def update_run_json(self, **changes: Any) -> None:
        """Rewrite run.json (only for a run this tracer started: a foreign script)."""
        try:
            rundir.update_run_json(self.run_dir, lambda meta: meta.update(changes))
        except (OSError, ValueError) as exc:
            log.info("megascope: could not update run.json: %s", exc)
