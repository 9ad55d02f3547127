"""Making the faults of docs/spec.md §5 real on the rank they name.

The fault language itself (parsing, validation) lives in :mod:`tracer.faults`; this module
turns a parsed :class:`~tracer.faults.Fault` into behaviour of a running rank:

* ``slow_rank`` — the rank's compute takes ``factor`` times as long. Inside every compute span
  the work runs and its own time ``t`` is measured: the span's elapsed time (after a device
  synchronize on CUDA) minus the time the rank spent blocked in collectives issued inside the
  span (a forward span with tensor-parallel collectives also holds the waits for the peers,
  which a slower GPU would not lengthen). The rank then sleeps ``(factor - 1) * t`` *inside*
  the span, so its time outside collectives becomes ``factor * t``: what the straggler
  detector measures.
* ``hang`` — at its first compute span of step ``S`` the rank blocks for good (a sleep loop), so
  it never enters its next collective and its peers sit waiting in theirs.
* ``crash`` — at its first compute span of step ``S`` the rank exits at once (``os._exit(1)``):
  no clean-up, no flush, as when a process is killed.
* ``pause`` — every ``every`` steps the rank stalls ``ms`` milliseconds outside any compute
  span, at the start of the step (like a garbage-collection pause).
* ``slow_data`` — loading this rank's batch takes ``ms`` milliseconds longer, inside the data
  span.
* ``slow_ckpt`` — every checkpoint persist on every rank takes ``ms`` milliseconds longer (a
  slow disk): :meth:`RankFaults.slow_disk` sleeps inside the write, on the thread that writes.
* ``seq_skew`` — the data-parallel replica of the rank (every rank with its dp index: all
  its pipeline stages, TP and CP ranks) loads ``round(factor * micro_batch_size)`` rows per
  microbatch (at least one more than the others when ``factor > 1``), of the data as it comes:
  it really computes more, its pipeline transfers are larger, and the gradient reduction,
  whose shapes are the parameters', is unchanged. :func:`replica_rows` gives every replica's
  rows from the faults alone, so every rank knows them without a collective; the loop passes
  the engine its replica's loss weight, its rows over the mean rows, so that the loss and the
  gradients stay the mean over every token of the global batch (the one-process run on the
  replicas' batches side by side).
* ``slow_link`` — see :class:`LinkFaults`: the *transfer phase* of every operation over the
  link (from the last member's arrival to its end, what the slow-link detector measures) lasts
  ``factor`` times as long as the same operation's on the comparable healthy links; arrival
  times untouched.

Compute and data faults are applied by :class:`RankFaults`, which the per-rank loop consults
from its hooks. :class:`LinkFaults` wraps functions of ``torch.distributed`` once, *before* the
tracer attaches, so the tracer's timing of a collective includes the injected delay; the same
wrappers keep :data:`COMM_CLOCK`, the time blocked in communication that ``slow_rank`` leaves
out of the compute it stretches.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import queue
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from tracer.faults import Fault
from tracer.rundir import coords_of

log = logging.getLogger(__name__)


class CommClock:
    """Seconds this process has spent blocked in ``torch.distributed`` calls.

    Kept by :class:`LinkFaults`' wrappers (installed when a slow link is injected anywhere or
    a slow rank on this rank): the time inside a blocking call, and inside ``wait()`` of the
    Work an async call returned. ``sync_cuda`` is set while a slowed compute span runs on
    CUDA: the wrappers then synchronize the device before and after the communication, so
    that the device time of the collective (its waiting included) counts as blocked and the
    compute queued before it does not.
    """

    def __init__(self) -> None:
        self.blocked_s = 0.0
        self.sync_cuda = False


COMM_CLOCK = CommClock()

# How late the latest sleeps woke, in ns: a loaded machine wakes a sleeper a little after the
# time asked for, and a fault that stretches a 0.3 ms transfer must not add 0.1 ms of that.
_LATE: deque[int] = deque([0], maxlen=64)


def sleep_until(deadline_ns: int) -> None:
    """Sleep until ``deadline_ns`` (``time.time_ns``), waking on time on average: each sleep
    asks to wake early by the median lateness of the recent ones."""
    late = sorted(_LATE)[len(_LATE) // 2]
    wake = deadline_ns - late
    pause = wake - time.time_ns()
    if pause <= 0:
        return
    time.sleep(pause / 1e9)
    _LATE.append(max(time.time_ns() - wake, 0))


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


# --------------------------------------------------------------------------- communication

# op -> the argument holding its payload (the bytes tell apart ops of one kind on one link)
_PAYLOAD: dict[str, str] = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "output",
    "reduce_scatter_single": "output",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": "",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
_P2P = ("send", "recv", "isend", "irecv")
_SENDS = ("send", "isend")
# Tags of the side group's messages: per group (a hash of its members) or per direction of a
# send/recv pair, so that messages about different channels never match each other.
_TAG_P2P = 1 << 20
_TAG_GROUP = 1 << 21
_TAG_REF = 1 << 22  # a comparable channel's estimates, sent to a slow channel's members
REF_SLOTS = 16  # kinds of operation per estimates message
STOP = -1  # the kind code of a comparable channel's last message
BATCH_MAX = 16  # ops per side-group message once a channel has warmed up
SAMPLES = 64  # transfer phases an estimate is the median of


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass(frozen=True)
class _Crossing:
    """One operation on a channel that crosses a slow link (``factor`` > 1), or on a healthy
    channel comparable to one (``factor`` 1: its transfer phases are the reference), as this
    rank sees it."""

    factor: float
    members: tuple[int, ...]  # the group's ranks (a collective) or (src, dst) of a send/recv
    role: str  # "group" (a collective), "send" or "recv"
    tag: int  # of its channel's side-group messages

    @property
    def key(self) -> tuple:
        return ("g", self.members) if self.role == "group" else ("p", *self.members)


def _kind_code(kind: tuple[str, int]) -> int:
    """A number for a kind of operation (op, bytes), the same on every rank."""
    return zlib.crc32(f"{kind[0]}:{kind[1]}".encode()) + 1


def _tag(key: tuple) -> int:
    return zlib.crc32(repr(key).encode()) % (1 << 20)


class _Channel:
    """The operations of one channel that crosses a slow link, or of a healthy channel
    comparable to one, as this rank sees them: a group's collectives, or one direction of a
    send/recv pair.

    Its members record, per operation, when they arrived and when it ended, and swap these
    in batches over the side group (1, 1, 2, 2, 4, 4, ... then ``BATCH_MAX`` operations per
    message, the same sizes on every member). From a batch, once the others' message is in
    (one batch later, so that no one waits for it), each operation's transfer phase is
    known exactly: for a collective the first end minus the last arrival, for a send/recv
    the receiver's end minus the later posting. Their median per kind of operation (op and
    bytes) is ``estimate``; sending no message per operation keeps the channel's own
    transfers as fast as the others'.
    """

    def __init__(self, crossing: _Crossing, rank: int) -> None:
        self.c = crossing
        src = crossing.members[0]
        if crossing.role == "send":
            self.tell, self.hear = (crossing.members[1],), ()
        elif crossing.role == "recv":
            self.tell, self.hear = (), (src,)
        else:
            self.tell = self.hear = tuple(r for r in crossing.members if r != rank)
        self.measured: deque[int] = deque(maxlen=100_000)  # transfer phases learnt (tests)
        self.batches = 0
        self.rows: list[tuple[int, int, tuple[str, int]]] = []  # (arrival, end, kind)
        # batches sent, waiting for the others' messages: (rows, buffers, all done)
        self.pending: deque[tuple[list, list, threading.Event]] = deque()
        self.samples: dict[tuple[str, int], deque[int]] = {}
        self.any: deque[int] = deque(maxlen=SAMPLES)

    def medians(self) -> dict[int, int]:
        """The median transfer phase per kind of operation (by :func:`_kind_code`)."""
        return {_kind_code(k): sorted(v)[len(v) // 2] for k, v in self.samples.items() if v}

    def batch_size(self) -> int:
        return min(1 << (self.batches // 2), BATCH_MAX)

    def estimate(self, kind: tuple[str, int]) -> int | None:
        """The median transfer phase (ns) of this kind of operation, else of any; None
        before the first batch has come back."""
        self.learn()
        got = self.samples.get(kind) or self.any
        if not got:
            return None
        return sorted(got)[len(got) // 2]

    def add(self, arrival: int, end: int, kind: tuple[str, int], side: _Side) -> None:
        """Record one operation; send the batch when it is full."""
        self.rows.append((arrival, end, kind))
        if len(self.rows) < self.batch_size():
            return
        rows, self.rows = self.rows, []
        self.batches += 1
        flat = torch.tensor([v for a, e, _ in rows for v in (a, e)], dtype=torch.int64)
        bufs = [torch.empty(2 * len(rows), dtype=torch.int64) for _ in self.hear]
        self.pending.append((rows, bufs, side.swap(flat, self.tell, bufs, self.hear, self.c.tag)))

    def learn(self, block: bool = False) -> bool:
        """Take in the batches whose messages from the others have arrived (all of them,
        waiting, with ``block``): never wait in the run, where the others may be behind.
        Returns whether something new was learnt."""
        learnt = False
        while self.pending:
            rows, bufs, ready = self.pending[0]
            if block:
                ready.wait()
            elif not ready.is_set():
                return learnt
            self.pending.popleft()
            if self.c.role == "send":
                continue
            learnt = True
            theirs = [buf.view(-1, 2).tolist() for buf in bufs]
            for i, (arrival, end, kind) in enumerate(rows):
                last = max([arrival] + [o[i][0] for o in theirs])
                first_end = end if self.c.role == "recv" else min([end] + [o[i][1] for o in theirs])
                t = max(first_end - last, 0)
                self.samples.setdefault(kind, deque(maxlen=SAMPLES)).append(t)
                self.any.append(t)
                self.measured.append(t)
        return learnt


class _Side:
    """The side gloo group, used by nothing else, and a thread that waits for its messages:
    gloo's point-to-point Works only complete in ``wait()``, and the rank must never wait for
    a peer that may be behind."""

    def __init__(self, pg: object) -> None:
        self.pg = pg
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="megascope-slow-link", daemon=True)
        self._thread.start()
        self.listeners: list[threading.Thread] = []

    def swap(
        self,
        msg: torch.Tensor,
        tell: tuple[int, ...],
        bufs: list[torch.Tensor],
        hear: tuple[int, ...],
        tag: int,
    ) -> threading.Event:
        """Send ``msg`` to ``tell``, receive ``bufs`` from ``hear``; the event is set once all
        of it is done."""
        works = [self.pg.send([msg], peer, tag) for peer in tell]  # type: ignore[attr-defined]
        works += [self.pg.recv([b], peer, tag) for b, peer in zip(bufs, hear, strict=True)]  # type: ignore[attr-defined]
        ready = threading.Event()
        self._jobs.put((works, msg, ready))
        return ready

    def listen(self, peer: int, tag: int, on_message: object) -> None:
        """Receive ``peer``'s estimates messages with ``tag`` for the rest of the run, on a
        thread of their own, handing each to ``on_message``."""

        def run() -> None:
            while True:
                buf = torch.empty(2 * REF_SLOTS, dtype=torch.int64)
                try:
                    self.pg.recv([buf], peer, tag).wait()  # type: ignore[attr-defined]
                except Exception as e:  # a peer gone at the end of a run
                    log.debug("slow link: estimates from %d lost (%s)", peer, e)
                    return
                pairs = buf.view(-1, 2).tolist()
                if pairs[0][0] == STOP:
                    return
                on_message(pairs)  # type: ignore[operator]

        thread = threading.Thread(target=run, name=f"megascope-slow-link-{peer}", daemon=True)
        thread.start()
        self.listeners.append(thread)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            works, _msg, ready = job
            try:
                for w in works:
                    w.wait()
            except Exception as e:  # a peer gone (the end of a run): nothing more to learn
                log.warning("fault: slow link's side messages stopped (%s)", e)
                return
            ready.set()


class _Op:
    """One call (or one op of a ``batch_isend_irecv``) crossing links, in flight on this
    rank: when it arrived, and its channels and kind."""

    def __init__(self, post_ns: int, crossings: list[_Crossing], kind: tuple[str, int]) -> None:
        self.post_ns = post_ns
        self.crossings = crossings
        self.kind = kind
        self.finished = False


class _Work(torch.distributed.Work):
    """An async op's Work whose completion, as its caller sees it, includes the stretched
    transfer phase (:meth:`LinkFaults._finish`) and whose ``wait()`` counts as blocked time.
    A ``torch.distributed.Work`` itself, so that the tracer wrapping it still sees async work
    (and ends its row at ``wait``); everything but ``wait`` is the real Work's (an op consumed
    through ``get_future()`` is not stretched)."""

    def __init__(self, work: object, owner: LinkFaults, op: _Op) -> None:
        super().__init__()
        self._work = work
        self._owner = owner
        self._op = op
        self._waited = False

    def wait(self, *args: object, **kwargs: object) -> object:
        owner, op = self._owner, self._op
        if self._waited:  # a gloo Work waited on twice does not return
            return True
        owner._sync_device()
        t0 = time.perf_counter()
        result = self._work.wait(*args, **kwargs)  # type: ignore[attr-defined]
        self._waited = True
        if not op.finished:
            op.finished = True
            owner._sync_device()
            owner._finish(op)
        owner.clock.blocked_s += time.perf_counter() - t0
        return result

    def is_completed(self) -> object:
        return self._work.is_completed()  # type: ignore[attr-defined]

    def is_success(self) -> object:
        return self._work.is_success()  # type: ignore[attr-defined]

    def exception(self) -> object:
        return self._work.exception()  # type: ignore[attr-defined]

    def source_rank(self) -> object:
        return self._work.source_rank()  # type: ignore[attr-defined]

    def _source_rank(self) -> object:
        return self._work._source_rank()  # type: ignore[attr-defined]

    def result(self) -> object:
        return self._work.result()  # type: ignore[attr-defined]

    def synchronize(self) -> object:
        return self._work.synchronize()  # type: ignore[attr-defined]

    def get_future(self) -> object:
        return self._work.get_future()  # type: ignore[attr-defined]

    def get_future_result(self) -> object:
        return self._work.get_future_result()  # type: ignore[attr-defined]

    def block_current_stream(self) -> object:
        return self._work.block_current_stream()  # type: ignore[attr-defined]

    def boxed(self) -> object:
        return self._work.boxed()  # type: ignore[attr-defined]

    def _get_op_type(self) -> object:
        return self._work._get_op_type()  # type: ignore[attr-defined]

    def _get_duration(self) -> object:
        return self._work._get_duration()  # type: ignore[attr-defined]


class LinkFaults:
    """Wraps ``torch.distributed``'s communication functions to slow the given links, and to
    keep :data:`COMM_CLOCK` (the time blocked in communication) on a slowed rank.

    The model of a slow link: an operation that crosses it runs unchanged (every member
    arrives, and the data moves, exactly as before); then its *transfer phase* (its end minus
    the last member's arrival, what a trace reads as transfer time) is made to last ``factor``
    times as long as the same kind of operation's on the comparable healthy links: each member
    that waits for it (a collective's members, a send/recv's receiver) sleeps
    ``(factor - 1) * t`` after its own end, ``t`` being the median transfer phase of that kind
    of operation (op and bytes) on the comparable channels. A sender, whose send does not wait
    for the transfer, is not held; the members of a collective add the same time and leave
    together: a slow link makes a collective longer but makes no rank late.

    Why the comparable channels' time and not the link's own: on shared cores, the ranks of a
    slow link that sleep leave the cores to the others, whose transfers get faster while their
    own get slower; a factor applied to their own time would read 1.3-1.7x too high against
    the links a trace compares them with.

    The transfer phases are measured, not modelled (:class:`_Channel`): every rank on a slow or
    comparable channel records when it arrived at each operation and when it ended, and the
    channel's members swap these in batches over a side gloo group (made at :meth:`install`,
    used by nothing else, so that the run's own groups and their sequence numbers are
    untouched); each comparable channel's leader then sends its medians to the slow channel's
    members (:meth:`_plan`). Until the comparable channels have reported, the link's own
    median is used.

    A collective crosses the link A-B when its group holds both A and B; a send/recv crosses
    it when its two ends are A and B. A group is comparable when it has the same size and
    rank strides (the other tp groups of a tp group), a send/recv pair when it joins the same
    places of a comparable group. Nested calls (``batch_isend_irecv`` calling ``isend``, one
    collective implemented with another) are handled once, at the outermost call. The members
    must complete a channel's operations in the same order (call order for a send): its
    batches are numbered by it.
    """

    def __init__(
        self,
        faults: Sequence[Fault],
        rank: int,
        device: str = "cpu",
        clock: CommClock | None = None,
    ) -> None:
        self.rank = rank
        self.cuda = device == "cuda"
        self.clock = clock if clock is not None else COMM_CLOCK
        self.links = [(frozenset(f.ranks), f.factor) for f in faults if f.kind == "slow_link"]
        self.timed = any(f.kind == "slow_rank" and f.rank == rank for f in faults)
        self._group_ranks: dict[int, tuple[int, ...]] = {}
        self._saved: list[tuple[object, str, object]] = []
        self._tls = threading.local()
        self._side: _Side | None = None
        self.channels: dict[_Crossing, _Channel] = {}
        # healthy channels comparable to a slow one (same kind of group, same places in it):
        # channel key -> the slow channel's key (see _plan)
        self.compare: dict[tuple, tuple] = {}
        self.report_to: dict[tuple, tuple[int, ...]] = {}  # comparable channels this rank leads
        # slow channel key -> comparable channel key -> kind code -> median transfer phase
        self.refs: dict[tuple, dict[tuple, dict[int, int]]] = {}
        self._refs_lock = threading.Lock()
        self.delayed_ops = 0  # operations stretched on this rank
        self.delay_s = 0.0  # and the sleep added to them

    # -- which operations cross a link
    def _members(self, group: object) -> tuple[int, ...]:
        import torch.distributed as dist

        key = id(group)
        if key not in self._group_ranks:
            pg = group if group is not None else dist.group.WORLD
            self._group_ranks[key] = tuple(sorted(dist.get_process_group_ranks(pg)))
        return self._group_ranks[key]

    def _factor(self, ranks: frozenset[int]) -> float:
        factor = 1.0
        for link, f in self.links:
            if link <= ranks:
                factor = max(factor, f)
        return factor

    def crossing(self, name: str, bound: dict[str, object]) -> _Crossing | None:
        """The slow link the op ``name`` with bound arguments crosses, or the healthy channel
        comparable to one that it is on; None if neither."""
        import torch.distributed as dist

        group = bound.get("group")
        if name in _P2P:
            send = name in _SENDS
            peer = bound.get("dst" if send else "src")
            group_peer = bound.get("group_dst" if send else "group_src")
            if peer is None and group_peer is not None:
                peer = dist.get_global_rank(group, int(group_peer))  # type: ignore[arg-type]
            if peer is None:
                return None
            peer = int(peer)  # type: ignore[arg-type]
            members = (self.rank, peer) if send else (peer, self.rank)
            role = "send" if send else "recv"
            tag = _TAG_P2P + (0 if members[0] < members[1] else 1)
            key: tuple = ("p", *members)
        else:
            members = self._members(group)
            role, key = "group", ("g", members)
            tag = _TAG_GROUP + _tag(key)
        factor = self._factor(frozenset(members))
        if factor > 1.0:
            return _Crossing(factor, members, role, tag)
        if key in self.compare:
            return _Crossing(1.0, members, role, tag)
        return None

    def _plan(self) -> None:
        """Which healthy channels are comparable to the slow ones, who sends their estimates
        and who listens (a collective call over the side group, at install).

        A group comparable to a slow group has the same size and the same rank strides (the
        other tp groups of a tp group); a send/recv pair comparable to a slow one joins the
        same places of a comparable group (the other pipeline links between the same
        stages). A comparable channel's lowest rank (a collective) or its receiver (a
        send/recv) sends its estimates to the slow channel's members that wait for it.
        """
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        mine: list[tuple[int, ...]] = []
        for pg in list(getattr(c10d._world, "pg_map", {})):
            try:
                mine.append(tuple(sorted(dist.get_process_group_ranks(pg))))
            except Exception:  # not a member, or no ranks to tell
                continue
        everyone: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=self._side.pg)  # type: ignore[union-attr]
        groups = sorted({g for got in everyone for g in (got or []) if len(g) >= 2})  # type: ignore[union-attr]

        def stride(g: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(r - g[0] for r in g)

        for link, _ in self.links:
            ends = sorted(link)
            for g in groups:
                if not link <= set(g):
                    continue
                for h in groups:
                    if h == g or len(h) != len(g) or stride(h) != stride(g) or link <= set(h):
                        continue
                    self.compare[("g", h)] = ("g", g)
                    for s_, d_ in ((ends[0], ends[1]), (ends[1], ends[0])):
                        self.compare[("p", h[g.index(s_)], h[g.index(d_)])] = ("p", s_, d_)

        def waiting(key: tuple) -> tuple[int, ...]:
            return key[1] if key[0] == "g" else (key[2],)

        def leader(key: tuple) -> int:
            return min(key[1]) if key[0] == "g" else key[2]

        for k, slow in self.compare.items():
            if leader(k) == self.rank:
                self.report_to[k] = waiting(slow)
            if self.rank in waiting(slow) and leader(k) != self.rank:
                self.refs.setdefault(slow, {})
                self._side.listen(  # type: ignore[union-attr]
                    leader(k), _TAG_REF + _tag(k), functools.partial(self._heard, slow, k)
                )

    def _heard(self, slow: tuple, source: tuple, pairs: list[list[int]]) -> None:
        got = {code: t for code, t in pairs if code}
        with self._refs_lock:  # listener threads write, the rank's own thread reads
            self.refs.setdefault(slow, {})[source] = got

    def _report(self, channel: _Channel) -> None:
        """A comparable channel's leader: send its estimates once it has learnt more."""
        targets = self.report_to.get(channel.c.key)
        if not channel.learn() or not targets:
            return
        medians = list(channel.medians().items())[:REF_SLOTS]
        slow = self.compare[channel.c.key]
        if self.rank in targets:
            self._heard(slow, channel.c.key, [list(m) for m in medians])
        flat = [v for m in medians for v in m] + [0] * (2 * (REF_SLOTS - len(medians)))
        msg = torch.tensor(flat, dtype=torch.int64)
        tell = tuple(r for r in targets if r != self.rank)
        self._side.swap(msg, tell, [], (), _TAG_REF + _tag(channel.c.key))  # type: ignore[union-attr]

    def reference(self, c: _Crossing, kind: tuple[str, int]) -> int | None:
        """The median over the comparable channels of their median transfer phase for this
        kind of operation; None before any has reported."""
        code = _kind_code(kind)
        with self._refs_lock:
            got = sorted(m[code] for m in self.refs.get(c.key, {}).values() if code in m)
        return got[len(got) // 2] if got else None

    def _channel(self, c: _Crossing) -> _Channel:
        if c not in self.channels:
            self.channels[c] = _Channel(c, self.rank)
        return self.channels[c]

    # -- the stretch
    def _sync_device(self) -> None:
        if self.clock.sync_cuda:
            torch.cuda.synchronize()

    def _sent(self, op: _Op) -> None:
        """A send crossing a link, at its call: its posting is recorded for the receiver."""
        for c in op.crossings:
            if c.role == "send":
                self._channel(c).add(op.post_ns, 0, op.kind, self._side)  # type: ignore[arg-type]

    def _finish(self, op: _Op) -> None:
        """After an op that waits for its transfer ended on this rank: on a slow channel,
        sleep ``(factor - 1)`` times the usual transfer phase of this kind of operation on the
        comparable healthy channels (this channel's own until they have reported)."""
        waits = [c for c in op.crossings if c.role != "send"]
        if not waits:
            return
        if self.cuda:  # the transfer has ended when the device is done with it
            torch.cuda.synchronize()
        end = time.time_ns()
        deadline, slow = end, False
        for c in waits:
            channel = self._channel(c)
            if c.factor > 1.0:
                slow = True
                t = self.reference(c, op.kind)
                if t is None:
                    t = channel.estimate(op.kind)
                if t is not None:
                    deadline = max(deadline, end + round((c.factor - 1.0) * t))
            channel.add(op.post_ns, end, op.kind, self._side)  # type: ignore[arg-type]
            self._report(channel)
        if not slow:
            return
        self.delayed_ops += 1
        self.delay_s += max(deadline - time.time_ns(), 0) / 1e9
        sleep_until(deadline)

    # -- the wrapping
    def _depth(self) -> int:
        return getattr(self._tls, "depth", 0)

    def _call(self, original: object, args: tuple, kwargs: dict) -> object:
        self._tls.depth = 1
        try:
            return original(*args, **kwargs)  # type: ignore[operator]
        finally:
            self._tls.depth = 0

    def _wrap(self, name: str, original: object) -> object:
        import inspect

        signature = inspect.signature(original)  # type: ignore[arg-type]
        always_async = name in ("isend", "irecv")
        payload = _PAYLOAD.get(name, "")
        op_kind = name.removeprefix("i") if name in _P2P else name  # isend and send alike

        def wrapper(*args: object, **kwargs: object) -> object:
            if self._depth():
                return original(*args, **kwargs)  # type: ignore[operator]
            # the whole wrapper counts as blocked, as the tracer's interval around it does
            self._sync_device()
            t0 = time.perf_counter()
            bound = signature.bind(*args, **kwargs).arguments
            cross = self.crossing(name, bound) if self.links else None
            kind = (op_kind, _nbytes(bound.get(payload))) if cross is not None else ("", 0)
            op = _Op(time.time_ns(), [cross] if cross is not None else [], kind)
            result = self._call(original, args, kwargs)
            self._sent(op)
            if always_async or bound.get("async_op"):
                if result is not None:
                    result = _Work(result, self, op)
            else:
                self._sync_device()
                self._finish(op)
            self.clock.blocked_s += time.perf_counter() - t0
            return result

        wrapper.__name__ = name
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_batch(self, original: object) -> object:
        import torch.distributed as dist

        def batch_isend_irecv(p2p_op_list: list) -> list:
            if self._depth():
                return original(p2p_op_list)  # type: ignore[operator]
            self._sync_device()
            t0 = time.perf_counter()
            ops = []
            for p in p2p_op_list:
                cross, kind = None, ("", 0)
                if self.links:
                    send = getattr(p.op, "__name__", "") == "isend"
                    peer = p.peer
                    if peer is None and getattr(p, "group_peer", None) is not None:
                        peer = dist.get_global_rank(p.group, p.group_peer)
                    name = "isend" if send else "irecv"
                    key = "dst" if send else "src"
                    cross = self.crossing(name, {"group": p.group, key: peer})
                    kind = (name.removeprefix("i"), _nbytes(p.tensor))
                ops.append(_Op(0, [cross] if cross is not None else [], kind))
            post = time.time_ns()
            for o in ops:
                o.post_ns = post
            works = self._call(original, (p2p_op_list,), {})
            for o in ops:
                self._sent(o)
            self.clock.blocked_s += time.perf_counter() - t0
            if not works:
                return works
            if len(works) != len(ops):  # one Work for the whole batch (NCCL coalesces)
                merged = _Op(post, [c for o in ops for c in o.crossings], ops[0].kind)
                ops = [merged] * len(works)
            return [_Work(w, self, o) for w, o in zip(works, ops, strict=True)]

        batch_isend_irecv.__wrapped__ = original  # type: ignore[attr-defined]
        return batch_isend_irecv

    def install(self) -> LinkFaults:
        """Replace the functions in ``torch.distributed`` and its ``distributed_c10d`` module.

        Does nothing when no slow link is given anywhere and this rank is not slowed. With a
        slow link it makes the side group, a collective call: every rank must install. Must
        run before the tracer attaches.
        """
        if not self.links and not self.timed:
            return self
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if self.links:
            self._side = _Side(dist.new_group(backend="gloo"))
            try:  # the tracer's Flight Recorder reader is not to read this traffic
                import tracer.api

                tracer.api.UNTRACED_GROUPS.add(self._side.pg)
            except ImportError:
                pass
            self._plan()
        for name in (*_PAYLOAD, "batch_isend_irecv"):
            original = getattr(c10d, name, None)
            if original is None:
                continue
            if name == "batch_isend_irecv":
                wrapped = self._wrap_batch(original)
            else:
                wrapped = self._wrap(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapped)
        if self.links:
            log.info("fault: slow links %s installed", [sorted(link) for link, _ in self.links])
        return self

    def transfer_phases(self) -> dict[tuple[int, ...], list[int]]:
        """The transfer phases (ns) measured so far, per channel's members (tests)."""
        out: dict[tuple[int, ...], list[int]] = {}
        for c, channel in self.channels.items():
            channel.learn(block=True)
            out.setdefault(c.members, []).extend(channel.measured)
        return out

    def uninstall(self) -> None:
        """Put the original functions back, and end the side group's traffic (tests; a run,
        which ends by ``os._exit``, never needs it). Collective: every rank must call it."""
        for channel in self.channels.values():
            channel.learn(block=True)
        if self._side is not None:
            for key, targets in self.report_to.items():
                stop = torch.full((2 * REF_SLOTS,), STOP, dtype=torch.int64)
                tell = tuple(r for r in targets if r != self.rank)
                self._side.swap(stop, tell, [], (), _TAG_REF + _tag(key)).wait()
            for thread in self._side.listeners:
                thread.join(timeout=30)
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
