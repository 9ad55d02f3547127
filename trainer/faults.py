"""Making the faults of docs/spec.md §5 real on the rank they name.

The fault language itself (parsing, validation) lives in :mod:`tracer.faults`; this module
turns a parsed :class:`~tracer.faults.Fault` into behaviour of a running rank:

* ``slow_rank`` — every compute span of the rank takes ``factor`` times as long: the work runs,
  its elapsed time ``t`` is measured (after a device synchronize on CUDA), then the rank sleeps
  ``(factor - 1) * t`` *inside* the span, so a tracer timing the span sees ``factor * t``.
* ``hang`` — at its first compute span of step ``S`` the rank blocks for good (a sleep loop), so
  it never enters its next collective and its peers sit waiting in theirs.
* ``crash`` — at its first compute span of step ``S`` the rank exits at once (``os._exit(1)``):
  no clean-up, no flush, as when a process is killed.
* ``pause`` — every ``every`` steps the rank stalls ``ms`` milliseconds outside any compute
  span, at the start of the step (like a garbage-collection pause).
* ``slow_data`` — loading this rank's batch takes ``ms`` milliseconds longer, inside the data
  span.
* ``slow_link`` — see :func:`install_link_faults`: the *transfer phase* of every operation that
  crosses the link is stretched on every member of the operation, arrival times untouched.

Compute and data faults are applied by :class:`RankFaults`, which the per-rank loop consults
from its hooks; link faults are installed once by wrapping functions of ``torch.distributed``
*before* the tracer attaches, so the tracer's timing of a collective includes the injected delay.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence

import torch

from tracer.faults import Fault

log = logging.getLogger(__name__)


class RankFaults:
    """The compute, data and pause faults that act on one rank.

    ``step`` must be kept current by the loop (:meth:`begin_step`); the hang and crash fire on
    the first compute span of their step, i.e. after the data span and before the rank's next
    collective of that step.
    """

    def __init__(self, faults: Sequence[Fault], rank: int, device: str = "cpu") -> None:
        mine = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.cuda = device == "cuda"
        self.slow_factor = 1.0
        for f in mine:
            if f.kind == "slow_rank":
                self.slow_factor *= f.factor
        self.hang_steps = {f.step for f in mine if f.kind == "hang"}
        self.crash_steps = {f.step for f in mine if f.kind == "crash"}
        self.pauses = [(f.every, f.ms) for f in mine if f.kind == "pause"]
        self.data_delay_s = sum(f.ms for f in mine if f.kind == "slow_data") / 1e3
        self.active = bool(mine)
        self.step = -1
        self._fired_this_step = False

    def begin_step(self, step: int) -> None:
        """Called as step ``step`` begins, outside every span: applies the pause fault."""
        self.step = step
        self._fired_this_step = False
        for every, ms in self.pauses:
            if step > 0 and step % every == 0:
                log.info("fault: pause %.0f ms at step %d", ms, step)
                time.sleep(ms / 1e3)

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
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        time.sleep((self.slow_factor - 1.0) * elapsed)

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        """Wrap the loading of one batch (call it inside the data span)."""
        yield
        if self.data_delay_s > 0:
            time.sleep(self.data_delay_s)


# --------------------------------------------------------------------------- slow links

# Nominal link used to estimate an operation's transfer time: a per-operation latency plus
# the bytes this member puts on the wire over a nominal bandwidth. The CPU numbers are of the
# order of gloo on loopback on a small shared machine (a 1 MiB all-reduce between two ranks
# takes a few ms), the CUDA numbers those of one InfiniBand NIC.
LINK_MODEL: dict[str, tuple[float, float]] = {  # device -> (latency s, bandwidth bytes/s)
    "cpu": (100e-6, 5e8),
    "cuda": (10e-6, 25e9),
}

# op -> (argument holding the payload, wire bytes per payload byte as a function of group size n);
# the factors are those of nccl-tests' bus bandwidth (ring algorithms).
_WIRE: dict[str, tuple[str, object]] = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "broadcast": ("tensor", lambda n: 1.0),
    "reduce": ("tensor", lambda n: 1.0),
    "all_gather": ("tensor", lambda n: n - 1),
    "all_gather_into_tensor": ("input_tensor", lambda n: n - 1),
    "all_gather_single": ("input_tensor", lambda n: n - 1),
    "reduce_scatter": ("output", lambda n: n - 1),
    "reduce_scatter_tensor": ("output", lambda n: n - 1),
    "reduce_scatter_single": ("output", lambda n: n - 1),
    "all_to_all": ("input_tensor_list", lambda n: (n - 1) / n),
    "all_to_all_single": ("input", lambda n: (n - 1) / n),
    "gather": ("tensor", lambda n: 1.0),
    "scatter": ("tensor", lambda n: 1.0),
    "barrier": ("", lambda n: 0.0),
}
_P2P = ("send", "recv", "isend", "irecv")


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class _DelayedWork:
    """An async op's Work whose completion, as its caller sees it, comes ``delay`` s later.

    ``wait()`` sleeps once after the real wait; ``get_future()`` chains a callback that sleeps
    before the value is handed on. Everything else is the real Work's.
    """

    def __init__(self, work: object, delay: float) -> None:
        self._work = work
        self._delay = delay
        self._slept = False

    def wait(self, *args: object, **kwargs: object) -> object:
        result = self._work.wait(*args, **kwargs)  # type: ignore[attr-defined]
        if not self._slept:
            self._slept = True
            time.sleep(self._delay)
        return result

    def get_future(self) -> object:
        delay = self._delay

        def later(fut: torch.futures.Future) -> object:
            time.sleep(delay)
            return fut.value()

        return self._work.get_future().then(later)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


class LinkFaults:
    """Wraps ``torch.distributed``'s communication functions to slow the given links.

    The model of a slow link: an operation that crosses it runs unchanged (so every member
    arrives, and the data moves, exactly as before), then its *transfer phase* is stretched by
    ``(factor - 1) * t`` on every member, with ``t = latency + wire_bytes / bandwidth`` from
    :data:`LINK_MODEL`. ``wire_bytes`` depends only on the payload and the group size, so all
    members of a collective compute the same delay and still leave it together: a slow link
    makes the collective longer but makes no rank late. A collective crosses the link A-B
    when its group holds both A and B; a send/recv crosses it when its two ends are A and B.
    Nested calls (``batch_isend_irecv`` calling ``isend``, one collective implemented with
    another) are delayed once, at the outermost call.
    """

    def __init__(self, faults: Sequence[Fault], rank: int, device: str = "cpu") -> None:
        self.rank = rank
        self.links = [(frozenset(f.ranks), f.factor) for f in faults if f.kind == "slow_link"]
        self.latency, self.bandwidth = LINK_MODEL.get(device, LINK_MODEL["cpu"])
        self._group_ranks: dict[int, frozenset[int]] = {}
        self._saved: list[tuple[object, str, object]] = []
        self._depth = 0
        self.delayed_ops = 0
        self.delay_s = 0.0

    # -- the model
    def _members(self, group: object) -> frozenset[int]:
        import torch.distributed as dist

        key = id(group)
        if key not in self._group_ranks:
            pg = group if group is not None else dist.group.WORLD
            self._group_ranks[key] = frozenset(dist.get_process_group_ranks(pg))
        return self._group_ranks[key]

    def _factor(self, ranks: frozenset[int]) -> float:
        factor = 1.0
        for link, f in self.links:
            if link <= ranks:
                factor = max(factor, f)
        return factor

    def transfer_s(self, wire_bytes: float) -> float:
        """The estimated transfer time of ``wire_bytes`` over the nominal link."""
        return self.latency + wire_bytes / self.bandwidth

    def delay_for(self, name: str, bound: dict[str, object]) -> float:
        """Extra seconds the op ``name`` with bound arguments takes on this rank (0 if none)."""
        import torch.distributed as dist

        group = bound.get("group")
        if name in _P2P:
            peer = bound.get("dst" if name in ("send", "isend") else "src")
            group_peer = bound.get("group_dst" if name in ("send", "isend") else "group_src")
            if peer is None and group_peer is not None:
                peer = dist.get_global_rank(group, int(group_peer))  # type: ignore[arg-type]
            if peer is None:
                return 0.0
            factor = self._factor(frozenset((self.rank, int(peer))))  # type: ignore[arg-type]
            wire = float(_nbytes(bound.get("tensor")))
        else:
            members = self._members(group)
            factor = self._factor(members)
            arg, scale = _WIRE[name]
            wire = _nbytes(bound.get(arg)) * scale(len(members)) if arg else 0.0  # type: ignore[operator]
        if factor <= 1.0:
            return 0.0
        return (factor - 1.0) * self.transfer_s(wire)

    # -- the wrapping
    def _record(self, delay: float) -> None:
        self.delayed_ops += 1
        self.delay_s += delay

    def _wrap(self, name: str, original: object) -> object:
        import inspect

        signature = inspect.signature(original)  # type: ignore[arg-type]

        def wrapper(*args: object, **kwargs: object) -> object:
            if self._depth:
                return original(*args, **kwargs)  # type: ignore[operator]
            bound = signature.bind(*args, **kwargs).arguments
            delay = self.delay_for(name, bound)
            self._depth += 1
            try:
                result = original(*args, **kwargs)  # type: ignore[operator]
            finally:
                self._depth -= 1
            if delay <= 0.0:
                return result
            self._record(delay)
            if name in ("isend", "irecv") or bound.get("async_op"):
                return _DelayedWork(result, delay) if result is not None else result
            time.sleep(delay)
            return result

        wrapper.__name__ = name
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_batch(self, original: object) -> object:
        import torch.distributed as dist

        def batch_isend_irecv(p2p_op_list: list) -> list:
            if self._depth:
                return original(p2p_op_list)  # type: ignore[operator]
            delay = 0.0
            for p in p2p_op_list:
                is_send = getattr(p.op, "__name__", "") == "isend"
                peer = p.peer
                if peer is None and getattr(p, "group_peer", None) is not None:
                    peer = dist.get_global_rank(p.group, p.group_peer)
                key = "dst" if is_send else "src"
                bound = {"tensor": p.tensor, "group": p.group, key: peer}
                delay = max(delay, self.delay_for("isend" if is_send else "irecv", bound))
            self._depth += 1
            try:
                works = original(p2p_op_list)  # type: ignore[operator]
            finally:
                self._depth -= 1
            if delay <= 0.0 or not works:
                return works
            self._record(delay)
            return [_DelayedWork(w, delay) for w in works]

        batch_isend_irecv.__wrapped__ = original  # type: ignore[attr-defined]
        return batch_isend_irecv

    def install(self) -> LinkFaults:
        """Replace the functions in ``torch.distributed`` and its ``distributed_c10d`` module.

        Does nothing when no slow link is given. Must run before the tracer attaches.
        """
        if not self.links:
            return self
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in (*_WIRE, *_P2P, "batch_isend_irecv"):
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
        log.info("fault: slow links %s installed", [sorted(link) for link, _ in self.links])
        return self

    def uninstall(self) -> None:
        """Put the original functions back (tests; a run never needs it)."""
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
