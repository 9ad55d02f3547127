"""What the link faults keep per link: the channels an operation crosses, their estimates of a
healthy transfer phase exchanged over a side group, and the Work of an async operation whose
completion includes the stretched transfer (:mod:`trainer.faults.links` uses them)."""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


# op -> the argument holding its payload (the bytes tell apart ops of one kind on one link)
PAYLOAD: dict[str, str] = {
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
P2P_OPS = ("send", "recv", "isend", "irecv")
SENDS = ("send", "isend")
# Tags of the side group's messages: per group (a hash of its members) or per direction of a
# send/recv pair, so that messages about different channels never match each other.
TAG_P2P = 1 << 20
TAG_GROUP = 1 << 21
TAG_REF = 1 << 22  # a comparable channel's estimates, sent to a slow channel's members
REF_SLOTS = 16  # kinds of operation per estimates message
STOP = -1  # the kind code of a comparable channel's last message
BATCH_MAX = 16  # ops per side-group message once a channel has warmed up
SAMPLES = 64  # transfer phases an estimate is the median of


def payload_bytes(value: object) -> int:
    """Bytes of a tensor, or the sum over a (nested) list or tuple of them; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    return 0


@dataclass(frozen=True)
class Crossing:
    """One operation on a channel that crosses a slow link (``factor`` > 1), or on a healthy
    channel comparable to one (``factor`` 1: its transfer phases are the reference), as this
    rank sees it."""

    factor: float
    members: tuple[int, ...]  # the group's ranks (a collective) or (src, dst) of a send/recv
    role: str  # "group" (a collective), "send" or "recv"
    tag: int  # of its channel's side-group messages

    @property
    def key(self) -> tuple:
        """The channel it is on: ``("g", members)`` for a group, ``("p", src, dst)`` for a send/recv
        direction."""
        return ("g", self.members) if self.role == "group" else ("p", *self.members)


def kind_code(kind: tuple[str, int]) -> int:
    """A number for a kind of operation (op, bytes), the same on every rank."""
    return zlib.crc32(f"{kind[0]}:{kind[1]}".encode()) + 1


def channel_tag(key: tuple) -> int:
    """A number for the channel ``key``, below 2**20 and the same on every rank: its part of the
    side group's message tags."""
    return zlib.crc32(repr(key).encode()) % (1 << 20)


class Channel:
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

    def __init__(self, crossing: Crossing, rank: int) -> None:
        self.c = crossing
        src = crossing.members[0]
        if crossing.role == "send":
            self.tell: tuple[int, ...] = (crossing.members[1],)
            self.hear: tuple[int, ...] = ()
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
        """The median transfer phase per kind of operation (by :func:`kind_code`)."""
        return {kind_code(k): sorted(v)[len(v) // 2] for k, v in self.samples.items() if v}

    def batch_size(self) -> int:
        """Operations per message now: 1, 1, 2, 2, 4, 4, ... up to :data:`BATCH_MAX`."""
        return min(1 << (self.batches // 2), BATCH_MAX)

    def estimate(self, kind: tuple[str, int]) -> int | None:
        """The median transfer phase (ns) of this kind of operation, else of any; None
        before the first batch has come back."""
        self.learn()
        got = self.samples.get(kind) or self.any
        if not got:
            return None
        return sorted(got)[len(got) // 2]

    def add(self, arrival: int, end: int, kind: tuple[str, int], side: Side) -> None:
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


class Side:
    """The side gloo group, used by nothing else, and a thread that waits for its messages:
    gloo's point-to-point Works only complete in ``wait()``, and the rank must never wait for
    a peer that may be behind."""

    def __init__(self, pg: torch.distributed.ProcessGroup) -> None:
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
        works = [self.pg.send([msg], peer, tag) for peer in tell]
        works += [self.pg.recv([b], peer, tag) for b, peer in zip(bufs, hear, strict=True)]
        ready = threading.Event()
        self._jobs.put((works, msg, ready))
        return ready

    def listen(self, peer: int, tag: int, on_message: Callable[[list], object]) -> None:
        """Receive ``peer``'s estimates messages with ``tag`` for the rest of the run, on a
        thread of their own, handing each to ``on_message``."""

        def run() -> None:
            while True:
                buf = torch.empty(2 * REF_SLOTS, dtype=torch.int64)
                try:
                    self.pg.recv([buf], peer, tag).wait()
                except Exception as e:  # a peer gone at the end of a run
                    log.debug("slow link: estimates from %d lost (%s)", peer, e)
                    return
                pairs = buf.view(-1, 2).tolist()
                if pairs[0][0] == STOP:
                    return
                on_message(pairs)

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


class Op:
    """One call (or one op of a ``batch_isend_irecv``) crossing links, in flight on this
    rank: when it arrived, and its channels and kind."""

    def __init__(self, post_ns: int, crossings: list[Crossing], kind: tuple[str, int]) -> None:
        self.post_ns = post_ns
        self.crossings = crossings
        self.kind = kind
        self.finished = False


class BlockedClock(Protocol):
    """What a stretched Work counts its wait into (trainer.faults.clock.CommClock)."""

    blocked_s: float


class WorkOwner(Protocol):
    """What a :class:`StretchedWork` asks of the faults that made it (a
    trainer.faults.links.LinkFaults, which imports this module)."""

    @property
    def clock(self) -> BlockedClock:
        """The rank's communication clock."""
        ...

    def sync_device(self) -> None:
        """Wait for the device where the transfers end there."""
        ...

    def finish(self, op: Op) -> None:
        """End ``op``'s stretched transfer phase."""
        ...


class StretchedWork(torch.distributed.Work):
    """An async op's Work whose completion, as its caller sees it, includes the stretched
    transfer phase (:meth:`LinkFaults.finish`) and whose ``wait()`` counts as blocked time.
    A ``torch.distributed.Work`` itself, so that the tracer wrapping it still sees async work
    (and ends its row at ``wait``); everything but ``wait`` is the real Work's (an op consumed
    through ``get_future()`` is not stretched)."""

    def __init__(self, work: Any, owner: WorkOwner, op: Op) -> None:
        super().__init__()
        self._work = work
        self._owner = owner
        self._op = op
        self._waited = False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        """Wait for the real Work, then end the op's stretched transfer (once) and count the wait as
        blocked time; a second wait returns at once."""
        owner, op = self._owner, self._op
        if self._waited:  # a gloo Work waited on twice does not return
            return True
        owner.sync_device()
        t0 = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        self._waited = True
        if not op.finished:
            op.finished = True
            owner.sync_device()
            owner.finish(op)
        owner.clock.blocked_s += time.perf_counter() - t0
        return result

    def is_completed(self) -> bool:
        """The real Work's."""
        return self._work.is_completed()

    def is_success(self) -> bool:
        """The real Work's."""
        return self._work.is_success()

    def exception(self) -> Any:
        """The real Work's."""
        return self._work.exception()

    def source_rank(self) -> int:
        """The real Work's."""
        return self._work.source_rank()

    def _source_rank(self) -> int:
        return self._work._source_rank()

    def result(self) -> list[torch.Tensor]:
        """The real Work's."""
        return self._work.result()

    def synchronize(self) -> None:
        """The real Work's."""
        return self._work.synchronize()

    def get_future(self) -> torch.futures.Future:
        """The real Work's (an op consumed through it is not stretched)."""
        return self._work.get_future()

    def get_future_result(self) -> object:
        """The real Work's."""
        return self._work.get_future_result()

    def block_current_stream(self) -> None:
        """The real Work's."""
        return self._work.block_current_stream()

    def boxed(self) -> torch.ScriptObject:
        """The real Work's."""
        return self._work.boxed()

    def _get_op_type(self) -> object:
        return self._work._get_op_type()

    def _get_duration(self) -> object:
        return self._work._get_duration()
