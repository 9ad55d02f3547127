"""Clocks: the host clock, CUDA-event timers, each rank's offset from rank 0, and a thread's CPU
time and wait for a core.

Host clock. ``now_ns()`` is ``perf_counter_ns()`` (monotonic, sub-microsecond) plus an epoch
offset fixed at import, so it reads as Unix time yet never steps backwards when NTP adjusts the
wall clock during a run.

CUDA timers. On a GPU a span's ends are ``torch.cuda.Event(enable_timing=True)`` taken from a
pool and *recorded* on the current stream: no synchronization on the hot path. The flusher later
asks ``event.query()``; a completed event is placed on the host clock through a reference
event recorded on an idle side stream right after reading the host clock:
``host_ns(ev) = ref_host_ns + ref.elapsed_time(ev) * 1e6``. The reference is renewed at every
flush (``recalibrate``), so the drift between the GPU and host clocks never accumulates.

Offsets. :func:`estimate_offsets` runs NTP-style round trips between rank 0 and every other
rank over a dedicated gloo group: rank r stamps t1, sends; rank 0 replies with its own time t0;
rank r stamps t4 on receipt. ``offset = t0 - (t1 + t4) / 2`` with error at most ``(t4-t1)/2``;
of several rounds the one with the smallest round trip wins. Timestamps are written as
``local + offset``, i.e. on rank 0's clock.

A thread's time. :func:`cpu_mark` notes the calling thread's CPU time and, where Linux gives it,
its run-queue delay (the time it waited, runnable, for a core); :func:`thread_since` gives what
each grew by since, on the same thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def unix_offset_ns(reads: int = 5) -> int:
    """``time.time_ns()`` less ``perf_counter_ns()``, read so that a preemption between the two
    reads cannot skew it: of ``reads`` bracketed reads, the one whose bracket is shortest."""
    best_gap, best = None, 0
    for _ in range(reads):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best_gap is None or after - before < best_gap:
            best_gap, best = after - before, wall - (before + after) // 2
    return best


EPOCH_OFFSET_NS = unix_offset_ns()  # now_ns() - perf_counter_ns()


def now_ns() -> int:
    """Unix time in ns on a monotonic clock (see the module docstring)."""
    return time.perf_counter_ns() + EPOCH_OFFSET_NS


CpuMark = tuple[int, int, int | None]  # the thread's CPU time and run-queue wait (ns), the thread

# Linux's per-thread scheduler statistics: time on a core, time runnable but waiting for one
# (the run queue), timeslices. Read through one descriptor per thread, kept open for the thread's
# life (``/proc/thread-self`` names the thread that opens it).
_SCHEDSTAT = "/proc/thread-self/schedstat"
_runq_readable = os.path.exists(_SCHEDSTAT)
_threads = threading.local()


class _SchedstatFile:
    """A thread's schedstat, open; closed when the thread ends (its locals are dropped)."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.open(_SCHEDSTAT, os.O_RDONLY)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def read_runq(on: bool) -> bool:
    """Turn reading the run-queue delay (:func:`runq_ns`) off, or back on where the system gives
    it; whether it is now read."""
    global _runq_readable
    _runq_readable = on and os.path.exists(_SCHEDSTAT)
    return _runq_readable


def runq_ns() -> int | None:
    """How long the calling thread has waited, runnable, for a core (its run-queue delay, the
    second field of Linux's schedstat), in ns; None where the system does not say. Where ranks
    share a host's cores this is what the scheduler, not the rank's work, added to its time."""
    global _runq_readable
    if not _runq_readable:
        return None
    try:
        f = getattr(_threads, "schedstat", None)
        if f is None:
            f = _threads.schedstat = _SchedstatFile()
        return int(os.pread(f.fd, 96, 0).split()[1])
    except (OSError, ValueError, IndexError):
        _runq_readable = False  # once unreadable, never again asked
        return None


def cpu_mark() -> CpuMark:
    """Where the calling thread's CPU time and run-queue wait stand now."""
    return time.thread_time_ns(), threading.get_ident(), runq_ns()


def thread_since(mark: CpuMark | None) -> tuple[int | None, int | None]:
    """The calling thread's CPU time and run-queue wait (:func:`runq_ns`) since ``mark``: both
    None without one, or where the mark was taken on another thread (its times are not one
    thread's); the wait None where the system does not say."""
    if mark is None or mark[1] != threading.get_ident():
        return None, None
    cpu, since = time.thread_time_ns() - mark[0], mark[2]
    now = runq_ns() if since is not None else None
    return cpu, None if now is None or since is None else now - since


class CudaTimer:
    """A pool of timing events and the reference that converts them to host time."""

    def __init__(self, pool_size: int) -> None:
        import torch

        self._torch = torch
        self._pool: list[Any] = [torch.cuda.Event(enable_timing=True) for _ in range(pool_size)]
        self._cap = pool_size * 4
        self._made = pool_size
        self._side = torch.cuda.Stream()
        self._ref: Any = None
        self._ref_host_ns = 0
        self.recalibrate(block=True)

    def record(self) -> Any | None:
        """An event recorded on the current stream, or None when the pool is exhausted."""
        if self._pool:
            ev = self._pool.pop()
        elif self._made < self._cap:
            ev = self._torch.cuda.Event(enable_timing=True)
            self._made += 1
        else:
            return None
        ev.record()
        return ev

    def recalibrate(self, block: bool = False) -> None:
        """Pair a fresh reference event with the host clock (called from the flusher)."""
        ref = self._torch.cuda.Event(enable_timing=True)
        host = now_ns()
        ref.record(self._side)
        if block:
            ref.synchronize()
        self._pending_ref = (ref, host)
        if block or ref.query():
            self._ref, self._ref_host_ns = ref, host

    def resolve(self, ev: Any) -> int | None:
        """Host ns of a completed event (None if it has not completed yet)."""
        pending = getattr(self, "_pending_ref", None)
        if pending is not None and pending[0] is not self._ref and pending[0].query():
            self._ref, self._ref_host_ns = pending
        if not ev.query():
            return None
        ns = self._ref_host_ns + int(self._ref.elapsed_time(ev) * 1e6)
        self._pool.append(ev)
        return ns

    def settle(self, timeout_s: float) -> Callable[[Any], int | None]:
        """A resolver for the last flush (close, hang): it polls each event until a deadline
        shared by all of them, then gives up (-1: written as null). Never ``synchronize``:
        on a hang the GPU may never get there."""
        deadline = time.monotonic() + timeout_s

        def resolve(ev: Any) -> int | None:
            while not ev.query():
                if time.monotonic() > deadline:
                    return -1
                time.sleep(0.001)
            return self.resolve(ev)

        return resolve


def _round_trips(pg: Any, rank: int, peers: list[int], rounds: int) -> int:
    """This rank's offset from rank 0 in ns, by ``rounds`` NTP-style exchanges per peer."""
    import torch

    buf = torch.zeros(1, dtype=torch.int64)
    # The process group's own methods, not torch.distributed's functions: those are wrapped
    # by the tracer, and this traffic is not the training's.
    if rank == 0:
        for peer in peers:
            for _ in range(rounds):
                pg.recv([buf], peer, 0).wait()
                buf[0] = now_ns()
                pg.send([buf], peer, 0).wait()
        return 0
    if rank not in peers:
        return 0
    best_rtt, best = None, 0
    for _ in range(rounds):
        t1 = now_ns()
        buf[0] = t1
        pg.send([buf], 0, 0).wait()
        pg.recv([buf], 0, 0).wait()
        t4 = now_ns()
        rtt = t4 - t1
        if best_rtt is None or rtt < best_rtt:
            best_rtt, best = rtt, int(buf[0]) - (t1 + t4) // 2
    log.debug("clock offset %d ns (round trip %d ns)", best, best_rtt)
    return best


def estimate_offsets(pg: Any, rank: int, peers: list[int], rounds: int) -> int:
    """Offset of this rank's :func:`now_ns` from rank 0's (0 on rank 0 and off ``peers``).

    ``pg`` is a gloo group over every rank (group rank = global rank), used by nothing else,
    so an estimate can run on a background thread while training goes on. ``peers`` are the
    ranks that measure: by default those on other hosts than rank 0, since processes of one
    host read the same kernel clock (their offset is 0 by construction, far more exact than
    any round trip). Rank 0 serves the peers one after another; a peer's first round trip
    may include waiting for its turn, which the minimum discards.
    """
    if pg is None or not peers:
        return 0
    return _round_trips(pg, rank, peers, max(1, rounds))


def clock_peers(pg: Any, world: int, same_host_too: bool) -> list[int]:
    """The ranks that estimate their offset: all but 0, or those on another host than 0's.

    Collective over ``pg`` (an all-gather of host names).
    """
    import socket

    import torch.distributed as dist

    if world <= 1 or pg is None:
        return []
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=pg)
    return [r for r in range(1, world) if same_host_too or hosts[r] != hosts[0]]
