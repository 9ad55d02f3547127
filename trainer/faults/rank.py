"""The compute, data, pause and checkpoint faults that act on one rank (:class:`RankFaults`),
and the rows of each data-parallel replica under ``seq_skew`` (:func:`replica_rows`)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from tracer.faults import Fault
from tracer.rundir import coords_of
from trainer.faults.clock import COMM_CLOCK, CommClock, sleep_until

log = logging.getLogger(__name__)


class RankFaults:
    """The compute, data and pause faults that act on one rank.

    ``step`` must be kept current by the loop (:meth:`begin_step`); the hang and crash fire on
    the first compute span of their step, i.e. after the data span and before the rank's next
    collective of that step. ``clock`` is where the time blocked in communication is read
    (:data:`COMM_CLOCK`, kept by :class:`LinkFaults`; without it installed nothing is blocked
    and the whole span counts as compute).
    """

    def __init__(
        self,
        faults: Sequence[Fault],
        rank: int,
        device: str = "cpu",
        clock: CommClock | None = None,
    ) -> None:
        # seq_skew acts in the data (replica_rows), not on this rank's spans
        mine = [f for f in faults if f.rank == rank and f.kind != "seq_skew"]
        self.rank = rank
        self.cuda = device == "cuda"
        self.clock = clock if clock is not None else COMM_CLOCK
        self._slow = [(f.step, f.factor) for f in mine if f.kind == "slow_rank"]
        self.slow_factor = self._slow_from(0)
        self.hang_steps = {f.step for f in mine if f.kind == "hang"}
        self.crash_steps = {f.step for f in mine if f.kind == "crash"}
        self.pauses = [(f.every, f.ms) for f in mine if f.kind == "pause"]
        self.data_delay_s = sum(f.ms for f in mine if f.kind == "slow_data") / 1e3
        self.ckpt_delay_s = sum(f.ms for f in faults if f.kind == "slow_ckpt") / 1e3
        self.offload_delay_s = sum(f.ms for f in mine if f.kind == "slow_offload") / 1e3
        self.active = bool(mine)
        self.step = -1
        self._fired_this_step = False
        self.compute_s = 0.0  # own compute measured in slowed spans (waits left out)
        self.added_s = 0.0  # and the sleep added to it

    def begin_step(self, step: int) -> None:
        """Called as step ``step`` begins, outside every span: applies the pause fault, and
        a slow_rank from its first slow step on."""
        self.step = step
        self._fired_this_step = False
        self.slow_factor = self._slow_from(step)
        for every, ms in self.pauses:
            if step > 0 and step % every == 0:
                log.info("fault: pause %.0f ms at step %d", ms, step)
                time.sleep(ms / 1e3)

    def _slow_from(self, step: int) -> float:
        """The slow_rank factor in force at ``step`` (a fault without a step: from the start)."""
        return math.prod(f for first, f in self._slow if step >= first)

    def _first_compute_of_step(self) -> None:
        if self._fired_this_step:
            return
        self._fired_this_step = True
        if self.step in self.crash_steps:
            log.error("fault: crash at step %d (exiting abruptly)", self.step)
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            os._exit(1)
        if self.step in self.hang_steps:
            log.error("fault: hang at step %d (blocking for good)", self.step)
            for handler in logging.getLogger().handlers:
                handler.flush()
            while True:
                time.sleep(1.0)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Wrap the work of one compute span (call it inside the tracer's span)."""
        if not self.active:
            yield
            return
        self._first_compute_of_step()
        if self.slow_factor == 1.0:
            yield
            return
        clock = self.clock
        if self.cuda:
            torch.cuda.synchronize()
        outer_sync, clock.sync_cuda = clock.sync_cuda, self.cuda
        blocked0 = clock.blocked_s
        t0 = time.perf_counter()
        try:
            yield
            if self.cuda:
                torch.cuda.synchronize()
        finally:
            clock.sync_cuda = outer_sync
        own = max(time.perf_counter() - t0 - (clock.blocked_s - blocked0), 0.0)
        extra = (self.slow_factor - 1.0) * own
        self.compute_s += own
        self.added_s += extra
        sleep_until(time.time_ns() + round(extra * 1e9))

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        """Wrap the loading of one batch (call it inside the data span)."""
        yield
        if self.data_delay_s > 0:
            time.sleep(self.data_delay_s)

    def slow_copy(self) -> None:
        """Called inside every optimizer-offload transfer of this rank: the slow_offload
        fault's extra time (on the offload thread)."""
        if self.offload_delay_s > 0:
            time.sleep(self.offload_delay_s)

    def slow_disk(self) -> None:
        """Called once inside every checkpoint persist: the slow_ckpt fault's extra time."""
        if self.ckpt_delay_s > 0:
            time.sleep(self.ckpt_delay_s)


def replica_rows(
    faults: Sequence[Fault], sizes: Mapping[str, int], micro_batch_size: int
) -> list[int]:
    """Rows per microbatch of each data-parallel replica (by dp index) under the ``seq_skew``
    faults (several on one replica multiply): ``micro_batch_size`` where none acts."""
    factors = [1.0] * int(sizes.get("dp", 1))
    for f in faults:
        if f.kind == "seq_skew":
            factors[coords_of(f.rank, sizes)["dp"]] *= f.factor
    return [
        micro_batch_size if f == 1.0 else max(round(f * micro_batch_size), micro_batch_size + 1)
        for f in factors
    ]
