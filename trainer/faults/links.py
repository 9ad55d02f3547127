"""``slow_link``: :class:`LinkFaults` wraps ``torch.distributed``'s communication functions
once, before the tracer attaches, to stretch the transfer phase of every operation over a
slowed link, and keeps :data:`~trainer.faults.clock.COMM_CLOCK` on a slowed rank."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tracer.faults import Fault
from trainer.faults.channels import (
    P2P_OPS,
    PAYLOAD,
    REF_SLOTS,
    SENDS,
    STOP,
    TAG_GROUP,
    TAG_P2P,
    TAG_REF,
    Channel,
    Crossing,
    Op,
    Side,
    StretchedWork,
    channel_tag,
    kind_code,
    payload_bytes,
)
from trainer.faults.clock import COMM_CLOCK, CommClock, sleep_until

log = logging.getLogger(__name__)


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

    The transfer phases are measured, not modelled (:class:`Channel`): every rank on a slow or
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
        self._side: Side | None = None
        self.channels: dict[Crossing, Channel] = {}
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
    def _members(self, group: Any) -> tuple[int, ...]:
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

    def crossing(self, name: str, bound: dict[str, Any]) -> Crossing | None:
        """The slow link the op ``name`` with bound arguments crosses, or the healthy channel
        comparable to one that it is on; None if neither."""
        import torch.distributed as dist

        group = bound.get("group")
        if name in P2P_OPS:
            send = name in SENDS
            peer = bound.get("dst" if send else "src")
            group_peer = bound.get("group_dst" if send else "group_src")
            if peer is None and group_peer is not None:
                # torch's own send/recv read a group rank of no group as one of the world's
                if group is None:
                    peer = int(group_peer)
                else:
                    peer = dist.get_global_rank(group, int(group_peer))
            if peer is None:
                return None
            peer = int(peer)
            members: tuple[int, ...] = (self.rank, peer) if send else (peer, self.rank)
            role = "send" if send else "recv"
            tag = TAG_P2P + (0 if members[0] < members[1] else 1)
            key: tuple = ("p", *members)
        else:
            members = self._members(group)
            role, key = "group", ("g", members)
            tag = TAG_GROUP + channel_tag(key)
        factor = self._factor(frozenset(members))
        if factor > 1.0:
            return Crossing(factor, members, role, tag)
        if key in self.compare:
            return Crossing(1.0, members, role, tag)
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
        everyone: list[list[tuple[int, ...]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=self._side.pg)  # type: ignore[union-attr]
        groups = sorted({g for got in everyone for g in (got or []) if len(g) >= 2})

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
                    leader(k), TAG_REF + channel_tag(k), functools.partial(self._heard, slow, k)
                )

    def _heard(self, slow: tuple, source: tuple, pairs: list[list[int]]) -> None:
        got = {code: t for code, t in pairs if code}
        with self._refs_lock:  # listener threads write, the rank's own thread reads
            self.refs.setdefault(slow, {})[source] = got

    def _report(self, channel: Channel) -> None:
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
        self._side.swap(msg, tell, [], (), TAG_REF + channel_tag(channel.c.key))  # type: ignore[union-attr]

    def reference(self, c: Crossing, kind: tuple[str, int]) -> int | None:
        """The median over the comparable channels of their median transfer phase for this
        kind of operation; None before any has reported."""
        code = kind_code(kind)
        with self._refs_lock:
            got = sorted(m[code] for m in self.refs.get(c.key, {}).values() if code in m)
        return got[len(got) // 2] if got else None

    def _channel(self, c: Crossing) -> Channel:
        if c not in self.channels:
            self.channels[c] = Channel(c, self.rank)
        return self.channels[c]

    # -- the stretch
    def sync_device(self) -> None:
        """Wait for the device where the clock says so (a CUDA rank's transfers end there)."""
        if self.clock.sync_cuda:
            torch.cuda.synchronize()

    def _sent(self, op: Op) -> None:
        """A send crossing a link, at its call: its posting is recorded for the receiver."""
        for c in op.crossings:
            if c.role == "send":
                self._channel(c).add(op.post_ns, 0, op.kind, self._side)  # type: ignore[arg-type]

    def finish(self, op: Op) -> None:
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

    def _call(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._tls.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            self._tls.depth = 0

    def _wrap(self, name: str, original: Callable[..., Any]) -> object:
        import inspect

        signature = inspect.signature(original)
        always_async = name in ("isend", "irecv")
        payload = PAYLOAD.get(name, "")
        op_kind = name.removeprefix("i") if name in P2P_OPS else name  # isend and send alike

        def wrapper(*args: object, **kwargs: object) -> object:
            if self._depth():
                return original(*args, **kwargs)
            # the whole wrapper counts as blocked, as the tracer's interval around it does
            self.sync_device()
            t0 = time.perf_counter()
            bound = signature.bind(*args, **kwargs).arguments
            cross = self.crossing(name, bound) if self.links else None
            kind = (op_kind, payload_bytes(bound.get(payload))) if cross is not None else ("", 0)
            op = Op(time.time_ns(), [cross] if cross is not None else [], kind)
            result = self._call(original, args, kwargs)
            self._sent(op)
            if always_async or bound.get("async_op"):
                if result is not None:
                    result = StretchedWork(result, self, op)
            else:
                self.sync_device()
                self.finish(op)
            self.clock.blocked_s += time.perf_counter() - t0
            return result

        wrapper.__name__ = name
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_batch(self, original: Callable[..., Any]) -> object:
        import torch.distributed as dist

        def batch_isend_irecv(p2p_op_list: list) -> list:
            if self._depth():
                return original(p2p_op_list)
            self.sync_device()
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
                    kind = (name.removeprefix("i"), payload_bytes(p.tensor))
                ops.append(Op(0, [cross] if cross is not None else [], kind))
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
                merged = Op(post, [c for o in ops for c in o.crossings], ops[0].kind)
                ops = [merged] * len(works)
            return [StretchedWork(w, self, o) for w, o in zip(works, ops, strict=True)]

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
            self._side = Side(dist.new_group(backend="gloo"))
            try:  # the tracer's Flight Recorder reader is not to read this traffic
                import tracer.api

                tracer.api.UNTRACED_GROUPS.add(self._side.pg)
            except ImportError:
                pass
            self._plan()
        for name in (*PAYLOAD, "batch_isend_irecv"):
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
                self._side.swap(stop, tell, [], (), TAG_REF + channel_tag(key)).wait()
            for thread in self._side.listeners:
                thread.join(timeout=30)
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
