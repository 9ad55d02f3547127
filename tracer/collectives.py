"""Collective capture: one ``collectives`` row per call of torch.distributed's Python API.

:class:`Recorder` replaces the functions of ``torch.distributed`` (the same objects as in
``torch.distributed.distributed_c10d``) with wrappers, taking whatever is installed at attach
time, so wrappers installed before (fault injection) are inside the timed region. A wrapper:

1. reads the group, the peer and the bytes from the arguments (nccl-tests conventions: the full
   array for all_gather / reduce_scatter / gather / scatter), numbers the call with a per-group
   counter (per group and direction-and-peer-pair for send/recv) so that the same collective has
   the same ``seq`` on every member, and stamps ``issue_ns``;
2. calls the real function with a thread-local flag set, so that functions calling each other
   (``all_gather_object`` -> ``all_gather``) give one row, not two;
3. ends the row when the call returns, or for async work (``async_op=True``, isend/irecv,
   ``batch_isend_irecv``) when its ``Work.wait()`` returns: the returned Work is a
   :class:`TracedWork` that delegates everything to the real one. gloo has no duration API, so
   these ends are host times; on CUDA tensors they are CUDA events recorded on the current
   stream, which the collective's stream joins at ``wait``. A host-timed async row's
   ``start_ns`` is when ``wait()`` was called: the rank was free until then.

A collective's ``seq`` is its group's own sequence number
(``ProcessGroup._get_sequence_number_for_group()`` read right after the call), the number Flight
Recorder gives the same collective, so that rows of the wrappers and of
:mod:`tracer.flight` (what the Python API never sees) share one numbering and the reader can skip
what the wrappers recorded. A backend without that number falls back to a counter per group.

An ``all_to_all`` or ``all_to_all_single`` also gives one ``work`` row of kind ``a2a_sent`` per
member of its group (``tracer.opspecs`` reads the bytes for each from the arguments): key the
member's global rank, group, seq, step and microbatch those of its ``collectives`` row. They are
buffered once the call has returned and its seq is final (async calls too: the bytes are known
at the call, whenever it completes); a call that raises or never returns gives none.

A collective that takes one tensor (all_reduce, broadcast, the tensor forms of all_gather and
reduce_scatter: nearly every call of a training step) goes through :meth:`Recorder._wrap_one`,
the same steps written out in one function; its timestamps are the clock reads that bound the
call, so the hot path reads the clock twice, not four times.

Rows in flight (inside a blocking call, or async and not waited for yet) are kept in
``inflight`` so that a hang can be written with a null ``end_ns``. Any failure in the
bookkeeping disables the recorder through ``on_error`` and the real call goes on untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tracer.clock import EPOCH_OFFSET_NS, now_ns
from tracer.meshinfo import group_name
from tracer.opspecs import OP_SPECS, OneTensor, OpSpec, tensor_nbytes
from tracer.patches import dressed
from tracer.schema import C
from tracer.works import TracedWork, Wrapped

if TYPE_CHECKING:
    from tracer.core import Tracer
    from tracer.flight import FlightReader

_P2P_SENDS = {"isend", "send"}
UNNUMBERED = -2  # a collective's seq until :meth:`Recorder._expect` numbers it
PROVEN = 16  # calls of an op on a group that took one sequence number each: trusted after


_DTYPES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """``float32`` for ``torch.float32`` (cached: str() of a dtype is slow for a hot path)."""
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _getter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[str, int], Any]:
    """An argument of a call by name, else by position (None when absent)."""

    def get(name: str, idx: int) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[idx] if idx < len(args) else None

    return get


class Recorder:
    """Owns the wrappers and the per-group counters of one attached tracer.

    ``tracer`` provides ``step_no``, ``mb`` (the innermost span's microbatch), ``buffers``,
    ``timer`` (a CudaTimer or None), ``progress()`` and ``fail(exc)``.
    """

    def __init__(self, tracer: Tracer, rank: int, names: dict[Any, str], world_name: str) -> None:
        self.tr = tracer
        self.rank = rank
        self.active = True
        self.inflight: dict[int, list[Any]] = {}
        self._names = names
        self._world_name = world_name
        self._groups: dict[Any, tuple[str, int, Any]] = {}
        self._ranks: dict[Any, list[int]] = {}  # group -> its members' global ranks, in order
        self._seq: dict[Any, int] = {}
        self._tls = threading.local()
        self._saved: dict[str, Callable[..., Any]] = {}
        self._saved_wrappers: dict[str, Callable[..., Any]] = {}
        self.flight: FlightReader | None = None  # where Flight Recorder works
        self._no_pg_seq: set[Any] = set()  # groups whose backend has no sequence number
        self._p2p_shift: dict[Any, int] = {}  # what send/recv added to a group's counter
        self.renamed: dict[str, str] = {}  # old group name -> new (the default group's)
        # rows of the async calls made while this is a list (tracer.ddpcomm: a comm hook's)
        self.collecting: list[list[Any]] | None = None
        self._complete_lock = threading.Lock()  # a Work's future completes on another thread

    # -- installing -------------------------------------------------------------------------
    def install(self) -> None:
        """Replace every function of OP_SPECS (and batch_isend_irecv) that this torch has."""
        for name, spec in OP_SPECS.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            wrapper = self.wrapper(spec, fn)
            if name in ("isend", "irecv"):
                wrapper = Wrapped(fn, wrapper)
            self._set(name, fn, wrapper)
        fn = getattr(dist, "batch_isend_irecv", None)
        if fn is not None:
            self._set("batch_isend_irecv", fn, self._wrap_batch(fn))

    def wrapper(self, spec: OpSpec, fn: Callable[..., Any]) -> Callable[..., Any]:
        """What :meth:`install` puts in place of ``fn``, a function of ``spec``."""
        one = spec.size
        if isinstance(one, OneTensor) and not (spec.p2p or spec.always_async or spec.sent):
            return self._wrap_one(spec, one, fn)
        return self._wrap(spec, fn)

    def _set(self, name: str, fn: Callable[..., Any], wrapper: Callable[..., Any]) -> None:
        self._saved[name] = fn
        setattr(dist, name, wrapper)
        if getattr(c10d, name, None) is fn:
            setattr(c10d, name, wrapper)
        self._saved_wrappers[name] = wrapper

    def uninstall(self) -> None:
        """Put the original functions back where ours are still in place."""
        self.active = False
        for name, fn in self._saved.items():
            ours = self._saved_wrappers[name]
            for module in (dist, c10d):
                if getattr(module, name, None) is ours:
                    setattr(module, name, fn)
        self._saved.clear()

    # -- the wrappers ---------------------------------------------------------------------
    def _wrap(self, spec: OpSpec, fn: Callable[..., Any]) -> Callable[..., Any]:
        tls = self._tls
        call = self._caller(spec, fn)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active or getattr(tls, "busy", False):
                return fn(*args, **kwargs)
            return call(args, kwargs)

        return dressed(wrapper, fn, spec.op)

    def _caller(
        self, spec: OpSpec, fn: Callable[..., Any]
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
        """One traced call of ``fn``, for any op and any argument: the general path."""
        tls = self._tls
        budget = self.tr.budget  # the bookkeeping's time is the tracer's (tracer/budget.py)
        single: dict[Any, int] = {}  # group -> calls that took one number each (_renumber)

        def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            t0 = perf_counter_ns()
            try:
                row = self._begin(spec, args, kwargs)
            except Exception as exc:  # bookkeeping must never break the call
                self.tr.fail(exc)
                return fn(*args, **kwargs)
            key = id(row)
            self.inflight[key] = row
            pg = row[C.pg]
            before = self._expect(row, pg)
            tls.busy = True
            t1 = perf_counter_ns()
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                self.complete([row], failed=True)
                raise
            finally:
                tls.busy = False
            t2 = perf_counter_ns()
            try:
                if spec.p2p or single.get(pg, 0) < PROVEN:
                    self._prove(single, row, pg, before)
                out = self._after(spec, row, result, args, kwargs)
            except Exception as exc:
                self.tr.fail(exc)
                return result
            if spec.sent is not None:
                self._record_sent(spec, row, args, kwargs)
            budget.capture_ns += t1 - t0 + perf_counter_ns() - t2
            return out

        return call

    def _wrap_one(self, spec: OpSpec, one: OneTensor, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The wrapper of a collective that takes one tensor (all_reduce, broadcast, the
        tensor forms of all_gather and reduce_scatter: nearly every call of a training step),
        with what :meth:`_wrap` does through ``_begin``, ``_expect`` and ``complete`` written
        out in one function: the hot path. Anything else it meets (CUDA tensors, async work,
        a backend without sequence numbers) goes through the same methods as :meth:`_wrap`."""
        tls = self._tls
        tr = self.tr
        budget = tr.budget
        groups = self._groups
        inflight = self.inflight
        shift = self._p2p_shift
        add = tr.buffers["collectives"].add
        single: dict[Any, int] = {}  # as in _wrap
        op, gidx = spec.op, spec.group_idx
        tname, tidx, times = one.name, one.idx, one.times_group
        end_at, width = C.end_ns, C.width  # positions in a row, as locals: the hot path
        call = self._caller(spec, fn)  # the general path

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active or getattr(tls, "busy", False):
                return fn(*args, **kwargs)
            t0 = perf_counter_ns()
            try:
                if kwargs:
                    group = kwargs.get("group", args[gidx] if gidx < len(args) else None)
                    t = kwargs[tname] if tname in kwargs else args[tidx]
                else:
                    group = args[gidx] if gidx < len(args) else None
                    t = args[tidx]
                info = groups.get(group)
                gname, gsize, pg = self._group(group) if info is None else info
                if tr.timer is not None and t.is_cuda or pg in self._no_pg_seq:
                    return call(args, kwargs)
                dtype = _DTYPES.get(t.dtype) or _dtype_name(t.dtype)
                nbytes = t.nbytes * gsize if times else t.nbytes
                before = int(pg._get_sequence_number_for_group())
                seq = before + 1 - shift.get(pg, 0)
                if self.flight is not None:
                    self.flight.note(pg, seq, seq)
            except Exception:  # the general path knows what went wrong, or says so (tr.fail)
                return call(args, kwargs)
            tr.beats += 1
            t1 = perf_counter_ns()
            issue = t1 + EPOCH_OFFSET_NS  # now_ns()
            # the columns in tracer/schema.py's order (row_columns), then the group
            row = [tr.step_no, tr.mb, op, gname, gsize, seq, -1, nbytes, dtype, issue, issue,
                   None, "host", pg]  # fmt: skip
            key = id(row)
            inflight[key] = row
            tls.busy = True
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                self.complete([row], failed=True)
                raise
            finally:
                tls.busy = False
            t2 = perf_counter_ns()
            try:
                if single.get(pg, 0) < PROVEN:
                    self._prove(single, row, pg, before)
                if result is None:  # returned: done (async_op=True returns its Work)
                    inflight.pop(key, None)
                    row[end_at] = t2 + EPOCH_OFFSET_NS
                    add(tuple(row[:width]))
                    tr.beats += 1
                    out = None
                else:
                    out = self._after(spec, row, result, args, kwargs)
            except Exception as exc:
                tr.fail(exc)
                return result
            budget.capture_ns += t1 - t0 + perf_counter_ns() - t2
            return out

        return dressed(wrapper, fn, spec.op)

    def _prove(self, single: dict[Any, int], row: list[Any], pg: Any, before: int | None) -> None:
        """After a call: number ``row`` from the group's counter (:meth:`_renumber`) and count,
        in ``single``, the calls of one op on ``pg`` that took exactly one number."""
        issued = self._renumber([row], pg, before)
        if issued == 1:
            single[pg] = single.get(pg, 0) + 1
        elif issued > 1:  # this op is more than one collective here: always read
            single[pg] = -(1 << 62)

    def _wrap_batch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        tls = self._tls

        def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
            if not self.active or getattr(tls, "busy", False):
                return fn(p2p_op_list)
            try:
                rows = [self._begin_batch_op(p2p) for p2p in p2p_op_list]
            except Exception as exc:
                self.tr.fail(exc)
                return fn(p2p_op_list)
            for row in rows:
                self.inflight[id(row)] = row
            pgs = {id(r[C.pg]): r[C.pg] for r in rows}
            before = {k: self._expect(None, pg) for k, pg in pgs.items()}
            tls.busy = True
            try:
                works = fn(p2p_op_list)
            except BaseException:
                self.complete(rows, failed=True)
                raise
            finally:
                tls.busy = False
            try:
                for k, pg in pgs.items():
                    self._renumber([], pg, before[k])
                return self._wrap_works(works, rows)
            except Exception as exc:
                self.tr.fail(exc)
                return works

        batch_isend_irecv.__wrapped__ = fn  # type: ignore[attr-defined]
        batch_isend_irecv.__doc__ = fn.__doc__
        return batch_isend_irecv

    def _wrap_works(self, works: Any, rows: list[list[Any]]) -> Any:
        """One TracedWork per op when the backend returned one Work per op; else the last
        Work ends them all (NCCL coalesces a batch into one)."""
        if not works:
            self.complete(rows)
            return works
        if len(works) == len(rows):
            return [TracedWork(w, self, [r]) for w, r in zip(works, rows, strict=True)]
        return [*works[:-1], TracedWork(works[-1], self, rows)]

    # -- rows -----------------------------------------------------------------------------
    def _group(self, group: Any) -> tuple[str, int, Any]:
        """(name, size, key) of a group, cached; None means the default group."""
        info = self._groups.get(group)
        if info is None:
            pg = c10d._get_default_group() if group is None else group
            name = self._names.get(pg)
            if name is None:
                if pg is c10d._get_default_group():
                    name = self._world_name
                else:
                    desc = str(getattr(pg, "group_desc", "") or "")
                    name = group_name(desc) or f"group{c10d._world.pg_names.get(pg, '?')}"
            info = (name, pg.size(), pg)
            self._groups[group] = info
        return info

    def group_of(self, group: Any) -> tuple[str, int, Any]:
        """(name, size, key) of a group as the rows name it; None means the default group."""
        return self._group(group)

    def named(self, pg: Any) -> str | None:
        """The name :meth:`name_group` (or attach's ``groups``) gave ``pg``, None where none."""
        return self._names.get(pg)

    def own_seq(self, pg: Any) -> int | None:
        """The number of ``pg``'s latest collective as Flight Recorder numbers it (its
        counter less what send/recv added), read right after a call issued it; None where
        the backend numbers none."""
        seq = self.pg_seq(pg)
        return None if seq is None else seq - self._p2p_shift.get(pg, 0)

    def name_group(self, pg: Any, name: str) -> None:
        """Call ``pg`` ``name`` from now on (rows already recorded keep the old name unless
        still in the buffer: :meth:`rename_rows`)."""
        old = self._group(pg)[0] if self.active else None
        self._names[pg] = name
        for key in [k for k, v in self._groups.items() if v[2] is pg]:
            del self._groups[key]  # in place: the one-tensor wrappers hold this dict
        if old is not None and old != name:
            self.renamed[old] = name

    def rename_rows(self, rows: list[tuple[Any, ...]], col: int = C.group) -> list[tuple[Any, ...]]:
        """Buffered rows of a renamed default group, under its new name (``col``: where the
        group name sits, ``C.group`` in a collectives row, ``W.group`` in a work row)."""
        if not self.renamed:
            return rows
        ren = self.renamed
        return [r[:col] + (ren[r[col]],) + r[col + 1 :] if r[col] in ren else r for r in rows]

    def pg_seq(self, pg: Any) -> int | None:
        """The group's own sequence number (Flight Recorder's ``collective_seq_id``)."""
        if pg in self._no_pg_seq:
            return None
        try:
            seq = int(pg._get_sequence_number_for_group())
        except Exception:
            self._no_pg_seq.add(pg)
            return None
        return seq

    def _expect(self, row: list[Any] | None, pg: Any) -> int | None:
        """Before the call: the group's sequence number now. A collective (``row``) is
        numbered here, by one rule: the group's own next number where its backend numbers
        them (noted now, so that a call that never returns, a hang, is not read twice), else
        the tracer's count of the group's collectives."""
        before = self.pg_seq(pg)
        if row is not None and row[C.seq] == UNNUMBERED:
            if before is None:
                row[C.seq] = self._next_seq(pg)
            else:
                seq = row[C.seq] = before + 1 - self._p2p_shift.get(pg, 0)
                if self.flight is not None:
                    self.flight.note(pg, seq, seq)
        return before

    def _renumber(self, rows: list[list[Any]], pg: Any, before: int | None) -> int:
        """After the call: a collective's seq is the group's, as Flight Recorder numbers it
        (gloo's group counter also counts send/recv, Flight Recorder's does not: what
        send/recv added is kept apart); the reader skips what the wrappers recorded. Returns
        how many numbers the call took (0 when unknown).

        The wrapper calls this until an op has taken exactly one number on a group
        :data:`PROVEN` times; from then on its seq is the number before the call plus one
        (:meth:`_expect`), one call into the backend fewer on the hot path. An op that took
        more (gloo's list ``reduce_scatter`` runs an all-reduce of its own) is always read."""
        if before is None:
            return 0
        after = self.pg_seq(pg)
        if after is None or after <= before:
            return 0
        if not rows or rows[0][C.peer] >= 0:  # send/recv (or a batch of them)
            self._p2p_shift[pg] = self._p2p_shift.get(pg, 0) + after - before
            if self.flight is not None:
                self.flight.p2p(pg, after - before)
            return after - before
        shift = self._p2p_shift.get(pg, 0)
        for row in rows:
            row[C.seq] = after - shift
        if self.flight is not None and after - before > 1:  # before + 1 was noted at the call
            self.flight.note(pg, before + 2 - shift, after - shift)
        return after - before

    def _next_seq(self, key: Any) -> int:
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        return seq

    def _begin(self, spec: OpSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        get = _getter(args, kwargs)
        group = get("group", spec.group_idx)
        gname, gsize, pg = self._group(group)
        nbytes, sample = spec.size(get, gsize)
        peer = -1
        if spec.p2p:
            peer = self._peer(get, spec, group)
            seq = self._p2p_seq(spec.op, pg, peer) if peer >= 0 else -1
        else:
            seq = UNNUMBERED  # numbered just before the call (_expect)
        issue = now_ns()
        tr = self.tr
        timer = tr.timer
        start: Any = issue
        source = "host"
        if timer is not None and sample is not None and getattr(sample, "is_cuda", False):
            start = timer.record() or issue
            source = "cuda"
        dtype = _dtype_name(sample.dtype) if sample is not None else ""
        tr.beats += 1  # progress (tracer.core.Tracer.progress): a call that hangs arms the watchdog
        # the columns in tracer/schema.py's order (row_columns), then the group (C.pg)
        return [tr.step_no, tr.mb, spec.op, gname, gsize, seq, peer, nbytes, dtype, issue, start,
                None, source, pg]  # fmt: skip

    def _begin_batch_op(self, p2p: Any) -> list[Any]:
        gname, gsize, pg = self._group(p2p.group)
        kind = "send" if getattr(p2p.op, "__name__", "") in _P2P_SENDS else "recv"
        if kind == "send" and p2p.op is not dist.isend:
            p2p.op = (
                dist.isend
            )  # see tracer.works.Wrapped: batch_isend_irecv tests ``op.op is isend``
        elif kind == "recv" and p2p.op is not dist.irecv:
            p2p.op = dist.irecv
        peer = int(p2p.peer)
        issue = now_ns()
        sample = p2p.tensor
        # the columns in tracer/schema.py's order (row_columns), then the group (C.pg)
        return [self.tr.step_no, self.tr.mb, kind, gname, gsize, self._p2p_seq(kind, pg, peer),
                peer, tensor_nbytes(sample), str(sample.dtype).removeprefix("torch."), issue,
                issue, None, "host", pg]  # fmt: skip

    def _global_ranks(self, pg: Any) -> list[int]:
        """The global rank of each member of ``pg``, in group-rank order (cached)."""
        ranks = self._ranks.get(pg)
        if ranks is None:
            ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
            self._ranks[pg] = ranks
        return ranks

    def _record_sent(
        self, spec: OpSpec, row: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """The ``a2a_sent`` work rows of an all-to-all whose per-peer bytes the arguments tell:
        one per member, keyed by its global rank, under the collective row's step,
        microbatch, group and (final) seq, so that the two tables join. A failure turns
        tracing off (``fail``); the call's result is returned all the same."""
        try:
            sent = spec.sent(_getter(args, kwargs), row[C.group_size])  # type: ignore[misc]
            if sent is None:
                return
            ranks = self._global_ranks(row[C.pg])
            add = self.tr.buffers["work"].add
            step, mb, group, seq = row[C.step], row[C.microbatch], row[C.group], row[C.seq]
            for peer, nbytes in zip(ranks, sent, strict=True):
                add((step, mb, "a2a_sent", peer, nbytes, group, seq))  # row_columns("work")
        except Exception as exc:
            self.tr.fail(exc)

    def _peer(self, get: Callable[..., Any], spec: OpSpec, group: Any) -> int:
        arg = spec.p2p or "dst"
        peer = get(arg, spec.peer_idx)
        if peer is None:
            gpeer = get("group_" + arg, 4)
            if gpeer is None:
                return -1
            peer = gpeer if group is None else dist.get_global_rank(group, gpeer)
        return int(peer)

    def _p2p_seq(self, op: str, pg: Any, peer: int) -> int:
        src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
        return self._next_seq((pg, src, dst))

    def _after(
        self,
        spec: OpSpec,
        row: list[Any],
        result: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        is_async = spec.always_async or bool(
            kwargs.get(
                "async_op", args[spec.async_idx] if 0 <= spec.async_idx < len(args) else False
            )
        )
        if spec.p2p and row[C.peer] < 0 and isinstance(result, int):
            row[C.peer] = result  # recv from any source returns the sender
            row[C.seq] = self._p2p_seq("recv", row[C.pg], result)
        if is_async and isinstance(result, dist.Work):
            if self.collecting is not None:
                self.collecting.append(row)
            return TracedWork(result, self, [row])
        self.complete([row])
        return result

    def waiting(self, rows: list[list[Any]]) -> None:
        """An async call's ``wait()`` begins: for a host-timed row, ``start_ns`` is when the
        rank began to wait (it worked until then: FSDP's prefetch overlaps compute)."""
        if rows and rows[0][C.end_ns] is None and rows[0][C.source] == "host":
            now = now_ns()
            for row in rows:
                if row[C.peer] < 0 or row[C.op] == "recv":
                    start = row[C.start_ns]
                    row[C.start_ns] = max(start, now) if isinstance(start, int) else now

    def complete(self, rows: list[list[Any]], failed: bool = False) -> None:
        """End rows now (at return, at ``wait`` or, on the backend's thread, when the future
        of their Work completes) and hand them to the buffer, once. A row whose start is None
        (its wait was to come: tracer.ddpcomm) and that completed before the rank waited
        starts at its end: the rank never waited for it."""
        if not rows or rows[0][C.end_ns] is not None:
            return
        tr = self.tr
        end: Any = None
        if not failed:
            end = now_ns()
            if tr.timer is not None and rows[0][C.source] == "cuda":
                end = tr.timer.record() or end
        with self._complete_lock:
            if rows[0][C.end_ns] is not None:  # ended meanwhile, on another thread
                return
            for row in rows:
                row[C.end_ns] = False if end is None else end
        add = tr.buffers["collectives"].add
        inflight = self.inflight
        for row in rows:
            inflight.pop(id(row), None)
            r = row[: C.width]
            r[C.end_ns] = end
            if r[C.start_ns] is None:
                r[C.start_ns] = row[C.issue_ns] if end is None else end
            add(tuple(r))
        tr.beats += 1  # progress (tracer.core.Tracer.progress)

    def inflight_rows(self) -> list[tuple[Any, ...]]:
        """Rows not completed yet, as rows with a null end (for a hang)."""
        rows = []
        for row in list(self.inflight.values()):
            r = row[: C.width]
            r[C.end_ns] = None
            if r[C.start_ns] is None:
                r[C.start_ns] = r[C.issue_ns]
            rows.append(tuple(r))
        return rows
