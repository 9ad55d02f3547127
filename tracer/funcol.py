"""The functional collectives in eager mode, timed on the host: issue, the rank's wait, its end.

DTensor, ``parallelize_module`` (tensor parallelism) and torchtitan issue their collectives
through ``torch.distributed._functional_collectives`` (``funcol``): a call issues the C++ op
(``torch.ops._c10d_functional.*``) and hands back an ``AsyncCollectiveTensor`` whose first use
waits for it (``trigger_wait``, or ``wait()``, both through the ``wait_tensor`` op). No wrapper
of ``torch.distributed`` sees either: without this module, Flight Recorder's entries of them are
``untimed`` rows on gloo, and a peer's wait for a late rank is only inferred by the analyzer.

:class:`FuncolTimer` wraps the module's issue functions (``all_reduce``, ``all_gather_single``
and its older and autograd spellings, ``reduce_scatter_single`` and its spellings,
``all_to_all_single``, ``broadcast``; DTensor calls them as ``funcol.NAME``, looked up at each
call) and the two methods of ``AsyncCollectiveTensor`` that wait. An issue gives a
``collectives`` row like an async call's of the collective wrappers (tracer/collectives.py):
numbered with the group's sequence number read after the call (so that Flight Recorder's entry
of the same collective is skipped), ``start_ns`` when the rank began to wait, ``end_ns`` when
the wait returned. An output tensor that is never waited for (dropped, or a later output took its
storage) ends as never waited (start = end). The methods are patched, not the module's
``wait_tensor``: Dynamo puts that function into graphs by name.

Under ``torch.compile`` (Dynamo tracing, fake or proxy tensors) the wrappers call straight
through after one check, so that a compiled graph holds the same ops and no graph break; the
functional collectives a compiled graph runs are C++ ops that no Python wrapper sees (they stay
Flight Recorder's rows). Only CPU tensors are timed: on CUDA, ``wait_tensor`` only orders
streams, the host does not block there (Flight Recorder's NCCL timing gives those durations).
Any failure in the bookkeeping turns the recorder off (``fail``) and the real call goes on.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import torch

from tracer.clock import now_ns
from tracer.patches import Patches
from tracer.schema import C

# funcol function -> (the op as the collectives table names it, index of the group argument,
# the output's bytes are the input's times the group's size: the full array, nccl-tests' way)
ISSUES: dict[str, tuple[str, int, bool]] = {
    "all_reduce": ("all_reduce", 2, False),
    "all_gather_single": ("all_gather", 2, True),
    "all_gather_tensor": ("all_gather", 2, True),
    "all_gather_single_autograd": ("all_gather", 2, True),
    "all_gather_tensor_autograd": ("all_gather", 2, True),
    "reduce_scatter_single": ("reduce_scatter", 3, False),
    "reduce_scatter_tensor": ("reduce_scatter", 3, False),
    "reduce_scatter_single_autograd": ("reduce_scatter", 3, False),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", 3, False),
    "all_to_all_single": ("all_to_all", 3, False),
    "broadcast": ("broadcast", 2, False),
}
MAX_PENDING = 4096  # outputs not waited for yet, beyond which the oldest end as never waited


def _storage_key(t: Any) -> int:
    """What an output and its views share: its storage's address."""
    return int(t.untyped_storage().data_ptr())


class FuncolTimer:
    """Times the functional collectives of one attached tracer's recorder
    (``tracer.collectives.Recorder``), in eager mode on CPU tensors."""

    def __init__(self, recorder: Any) -> None:
        self.rec = recorder
        self.tr = recorder.tr
        self.pending: dict[int, list[Any]] = {}  # output storage -> its row, until waited for
        self._groups: dict[Any, Any] = {}  # the script's group argument -> its ProcessGroup
        self._tls = threading.local()
        self._patches = Patches()
        self.rows = 0

    # -- installing -------------------------------------------------------------------------
    def install(self) -> bool:
        """Wrap what this torch has; False where it has no functional collectives."""
        try:
            import torch.distributed._functional_collectives as funcol
        except Exception:
            return False
        act = getattr(funcol, "AsyncCollectiveTensor", None)
        if act is None:
            return False
        # fake or proxy tensors too (make_fx); Dynamo's own check comes first, the cheapest
        tracing = getattr(funcol, "_are_we_tracing", None) or torch.compiler.is_compiling
        self._resolve = getattr(funcol, "_resolve_group_name", None)
        if self._resolve is None:
            return False
        for name, (op, gidx, times) in ISSUES.items():
            fn = getattr(funcol, name, None)
            if fn is not None:
                self._patches.put(funcol, name, fn, self._issue(fn, op, gidx, times, act, tracing))
        for name in ("trigger_wait", "wait"):
            fn = act.__dict__.get(name)
            if fn is not None:
                self._patches.put(act, name, fn, self._waiter(fn, name == "trigger_wait"))
        return True

    def uninstall(self) -> None:
        """Put the originals back where ours are still in place; rows not waited for end as
        never waited."""
        self._patches.restore()
        self.drop_pending()

    def drop_pending(self) -> None:
        """End every row not waited for yet as never waited (start = end)."""
        rows = list(self.pending.values())
        self.pending.clear()  # in place: the wrappers hold this dict
        for row in rows:
            self._unwaited(row)

    # -- the wrappers -----------------------------------------------------------------------
    def _pg(self, group: Any) -> Any:
        """The ProcessGroup of a functional collective's group argument (cached)."""
        key = group
        try:
            pg = self._groups.get(key)
        except TypeError:  # a list of ranks (the key only: funcol reads a tuple otherwise)
            key = ("ranks", *group)
            pg = self._groups.get(key)
        if pg is None:
            import torch.distributed.distributed_c10d as c10d

            with warnings.catch_warnings():  # the script's own call warns of its spelling
                warnings.simplefilter("ignore")
                pg = c10d._resolve_process_group(self._resolve(group))  # type: ignore[misc]
            self._groups[key] = pg
        return pg

    def _issue(
        self,
        fn: Callable[..., Any],
        op: str,
        gidx: int,
        times: bool,
        act: type,
        tracing: Callable[[], bool],
    ) -> Callable[..., Any]:
        tls = self._tls
        rec = self.rec
        tr = self.tr
        pending = self.pending
        compiling = torch.compiler.is_compiling
        dtypes: dict[Any, str] = {}

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if compiling() or not rec.active or getattr(tls, "busy", False) or tracing():
                return fn(*args, **kwargs)
            t0 = perf_counter_ns()
            try:
                t = args[0] if args else kwargs["self"]
                if t.is_cuda:
                    return fn(*args, **kwargs)
                group = kwargs["group"] if "group" in kwargs else args[gidx]
                pg = self._pg(group)
                gname, gsize, _ = rec.group_of(pg)
                nbytes = t.nbytes * gsize if times else t.nbytes
                dtype = dtypes.get(t.dtype)
                if dtype is None:
                    dtype = dtypes[t.dtype] = str(t.dtype).removeprefix("torch.")
            except Exception as exc:
                tr.fail(exc)
                return fn(*args, **kwargs)
            issue = now_ns()
            t1 = perf_counter_ns()
            tls.busy = True  # a spelling that calls another (all_gather_tensor) gives one row
            try:
                out = fn(*args, **kwargs)
            finally:
                tls.busy = False
            t2 = perf_counter_ns()
            try:
                seq = rec.own_seq(pg)
                if seq is None:  # no group numbering: Flight Recorder's rows stand
                    return out
                # a row in the schema's order (tracer.schema.C), its group after the columns
                row = [tr.step_no, tr.mb, op, gname, gsize, seq, -1, nbytes, dtype, issue,
                       issue, None, "host", pg]  # fmt: skip
                if rec.flight is not None:
                    rec.flight.note(pg, seq, seq)
                tr.beats += 1
                self.rows += 1
                waits: Any = out if isinstance(out, act) else None  # an AsyncCollectiveTensor
                if waits is not None and not waits.completed:
                    key = _storage_key(waits.elem)
                    old = pending.pop(key, None)
                    if old is not None:  # its storage was freed and reused: never waited
                        self._unwaited(old)
                    if len(pending) >= MAX_PENDING:
                        self._unwaited(pending.pop(next(iter(pending))))
                    pending[key] = row
                    rec.inflight[id(row)] = row
                else:  # waited inside the call (a gather on another dim): its whole call
                    rec.complete([row])
            except Exception as exc:
                tr.fail(exc)
                return out
            tr.budget.capture_ns += t1 - t0 + perf_counter_ns() - t2
            return out

        return wrapper

    def _waiter(self, fn: Callable[..., Any], once: bool) -> Callable[..., Any]:
        rec = self.rec
        pending = self.pending
        compiling = torch.compiler.is_compiling

        def wait(this: Any, *args: Any, **kwargs: Any) -> Any:
            # under Dynamo the first test is a constant: nothing below is traced (no guard)
            if compiling() or not pending or (once and this.completed):
                return fn(this, *args, **kwargs)
            try:
                row = pending.pop(_storage_key(this.elem), None)
            except Exception:
                row = None
            if row is None:
                return fn(this, *args, **kwargs)
            rec.waiting([row])
            try:
                out = fn(this, *args, **kwargs)
            except BaseException:
                rec.complete([row], failed=True)
                raise
            rec.complete([row])
            return out

        return wait

    def _unwaited(self, row: list[Any]) -> None:
        """End ``row`` as never waited for: it completed before any wait (start = end)."""
        row[C.start_ns] = None
        self.rec.complete([row])
