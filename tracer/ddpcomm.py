"""DDP's gradient all-reduces, timed on the host: issue, the rank's wait, completion.

DDP's C++ reducer issues each bucket's all-reduce straight to the process group, where no
wrapper of ``torch.distributed`` sees it, and waits for it in C++ at the end of the backward:
Flight Recorder knows such a collective was issued and completed, but on gloo not when
(``untimed`` rows). That holds for ``torch.compile(DDP(model))`` as well: the compiler splits the
graph at the buckets' boundaries and the same reducer runs the all-reduces.

:class:`DdpComm` registers a communication hook, DDP's supported way to run a bucket's
collective, on every ``DistributedDataParallel`` made on the host (CPU parameters) after attach.
The hook does what DDP does without one (``allreduce_hook``: the bucket divided by the group's
size, all-reduced) through ``torch.distributed.all_reduce``, which the collective wrappers time
(tracer/collectives.py): its Work's future ends the row when the reduction completes, on the
backend's thread. The rank waits for a bucket from when the last bucket of the backward is
issued (``GradBucket.is_last()``: DDP then finishes the backward and waits for every bucket);
that is the row's ``start_ns``, and a bucket that completed before then was never waited for
(start = end). Rows are numbered with the group's sequence number, so Flight Recorder's entries
of the same all-reduces are skipped.

A script that registers a hook of its own (``register_comm_hook``, or a built-in one) gets it
run inside ours: its collectives are recorded and timed the same way. DDP with its Python
reducer (compiled autograd), mixed precision or CUDA parameters is left alone.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from tracer.clock import now_ns
from tracer.patches import Patches
from tracer.schema import C

if TYPE_CHECKING:
    from tracer.core import Tracer
    from tracer.parts import RecorderPart

log = logging.getLogger(__name__)


class _Bucketing:
    """What the hook of one DDP module keeps: its group, the script's own hook (None: DDP's
    default all-reduce), and the rows of this backward not waited for yet."""

    __slots__ = ("pg", "user", "pending", "__weakref__")

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.user: tuple[Any, Any] | None = None  # (hook, state) the script registered
        self.pending: list[list[Any]] = []

    def reduce(self, bucket: Any) -> Any:
        """The bucket's collective: the script's hook, else DDP's default all-reduce."""
        if self.user is not None:
            hook, state = self.user
            return hook(state, bucket)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(self.pg, bucket)


def mark_waits(pending: list[list[Any]], now: int) -> None:
    """The rank begins to wait for ``pending`` rows at ``now``: the start of each row not ended
    yet (a row's start is None until its wait begins)."""
    for row in pending:
        if row[C.end_ns] is None:
            start = row[C.start_ns]
            row[C.start_ns] = now if start is None else max(start, now)


def defer_waits(rows: list[list[Any]]) -> None:
    """Rows of async calls whose wait is to come: their start is unknown until it begins (a row
    already ended, or already waited for, is left as it is)."""
    for row in rows:
        if row[C.end_ns] is None and row[C.start_ns] == row[C.issue_ns]:
            row[C.start_ns] = None


class DdpComm:
    """Installs the timing hook on each DDP module made after attach (the module docstring)."""

    def __init__(self, tr: Tracer, recorder: RecorderPart) -> None:
        self.tr = tr
        self.recorder = recorder
        self.hooked = 0  # DDP modules given the hook
        self._states: weakref.WeakKeyDictionary[Any, _Bucketing] = weakref.WeakKeyDictionary()
        self._patches = Patches()

        def hook(state, bucket):  # unannotated: DDP checks a hook's annotations
            return self._on_bucket(state, bucket)

        self.hook = hook

    def install(self) -> None:
        """Wrap DDP's ``__init__`` (the hook goes in after it) and its two ways to register a
        hook (the script's hook then runs inside ours)."""
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
        except ImportError:
            return
        self._patch(DDP, "__init__", self._init)
        self._patch(DDP, "register_comm_hook", self._register)
        self._patch(DDP, "_register_builtin_comm_hook", self._register_builtin)

    def uninstall(self) -> None:
        """Put DDP's methods back. A hook already registered stays (DDP cannot drop one); with
        the recorder off it runs the bucket's collective untraced."""
        self._patches.restore()

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        fn = owner.__dict__.get(name)
        if fn is None:
            return
        self._patches.put(owner, name, fn, make(fn))

    # -- DDP's methods ------------------------------------------------------------------------
    def _init(self, init: Any) -> Any:
        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            init(ddp, *args, **kwargs)
            if self.recorder.active and self.tr.enabled:
                try:
                    self._hook_module(ddp)
                except Exception as exc:  # the module works untimed: Flight Recorder reads it
                    log.info("megascope: DDP's all-reduces are not timed: %s", exc)

        return __init__

    def _hook_module(self, ddp: Any) -> None:
        if not hookable(ddp):
            return
        state = _Bucketing(ddp.process_group)
        ddp.register_comm_hook(state, self.hook)  # ours: register() lets it through
        self._states[ddp] = state
        self.hooked += 1

    def _register(self, register: Any) -> Any:
        def register_comm_hook(ddp: Any, state: object, hook: Any) -> None:
            ours = self._states.get(ddp)
            if hook is self.hook or ours is None or ours.user is not None:
                return register(ddp, state, hook)  # ours, or DDP's own rules (once only)
            ours.user = (hook, state)
            return None

        return register_comm_hook

    def _register_builtin(self, register: Any) -> Any:
        def _register_builtin_comm_hook(ddp: Any, comm_hook_type: Any) -> None:
            ours = self._states.get(ddp)
            user = builtin_hook(comm_hook_type)
            if ours is None or ours.user is not None or user is False:
                return register(ddp, comm_hook_type)
            if user is not None:
                ours.user = (user, ours.pg)
            return None

        return _register_builtin_comm_hook

    # -- the hook -------------------------------------------------------------------------------
    def _on_bucket(self, state: _Bucketing, bucket: Any) -> Any:
        """A bucket's gradients are ready: run its collective, recording its rows; the last
        bucket of the backward is when the rank begins to wait for them all."""
        rec = self.recorder
        if not rec.active:
            return state.reduce(bucket)
        rows: list[list[Any]] = []
        rec.collecting = rows
        try:
            fut = state.reduce(bucket)
        finally:
            rec.collecting = None
        try:
            defer_waits(rows)
            pending = [r for r in state.pending if r[C.end_ns] is None] + rows
            if bucket.is_last():
                mark_waits(pending, now_ns())
                pending = []
            state.pending = pending
        except Exception as exc:
            self.tr.fail(exc)
        return fut


def hookable(ddp: Any) -> bool:
    """Whether the hook may time ``ddp``: the C++ reducer, no mixed precision, host parameters."""
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "reducer", None) is None:
        return False
    if getattr(ddp, "mixed_precision", None) is not None:
        return False
    return str(getattr(ddp, "device_type", "cpu")) == "cpu"


def builtin_hook(kind: Any) -> Any:
    """The Python hook that does what built-in hook ``kind`` does: None for the plain all-reduce
    (ours already), False for one it does not know (DDP registers it, and the hook stays ours
    only if none was)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if kind == dist.BuiltinCommHookType.ALLREDUCE:
        return None
    if kind == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    return False
