"""The public tracing API: attach, step, span, spanned, record_span, close, current.

```python
import tracer
dist.init_process_group(...)
tracer.attach("runs/r1")                 # collective: call it on every rank
for step in range(n):
    tracer.step(step)
    with tracer.span("forward", microbatch=i): ...
tracer.close()                           # also at exit and on SIGTERM
```

Without an attached tracer every function here is a no-op that costs a global lookup, and
``span`` returns one shared null context. Spans nest; a span's microbatch (and that of every
collective issued inside it) is its own when given, else the enclosing span's.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tracer.autospans import AUTO_SPAN_NAMES
from tracer.config import TracerConfig
from tracer.core import Tracer
from tracer.lifecycle import exit_status, finish, write_topology_and_run_json
from tracer.spans import Span

log = logging.getLogger(__name__)

_NULL = contextlib.nullcontext()
# Process groups a tool uses for its own traffic (the trainer's fault injection), added before
# attach: Flight Recorder's reader skips them, as it skips the tracer's own clock group.
UNTRACED_GROUPS: set[Any] = set()


class _Holder:
    """The attached tracer of this process (one per process, as there is one rank)."""

    tracer: Tracer | None = None
    sigterm_prev: Any = None
    handlers = False
    closing_thread: int | None = None  # the thread running close, while it runs
    term_pending = False
    close_lock = threading.Lock()


_STATE = _Holder()


def current() -> Tracer | None:
    """The attached tracer, or None."""
    return _STATE.tracer


def span(name: str, kind: str = "compute", microbatch: int = -1) -> Any:
    """A context manager timing ``name`` on this rank (a null context when not attached)."""
    tr = _STATE.tracer
    if tr is None or not tr.enabled:
        return _NULL
    if tr.auto is not None and tr.auto.spans and name in AUTO_SPAN_NAMES:
        tr.auto.yield_spans()  # the script draws its own forward/backward/optimizer/data
    return Span(tr, name, kind, microbatch)


def record_span(
    name: str,
    kind: str,
    start_ns: Any,
    end_ns: Any,
    *,
    step: int,
    microbatch: int = -1,
    nbytes: int | None = None,
    direction: str | None = None,
    stream: str | None = None,
) -> None:
    """A span timed by the caller, on any thread: ``start_ns``/``end_ns`` from
    :func:`tracer.clock.now_ns`, or two CUDA events (timing enabled) recorded on whatever
    stream the work ran on (source ``cuda``); ``step`` the step it belongs to. For work beside
    the training loop (a checkpoint written in the background: kind ``background``; an
    optimizer-offload transfer: kind ``offload`` with its ``nbytes``, ``direction`` and
    ``stream``), which :func:`span` cannot time, since it keeps the training thread's
    microbatch and step."""
    tr = _STATE.tracer
    if tr is None or not tr.enabled:
        return
    source = "host" if isinstance(start_ns, int) else "cuda"
    try:
        row = (step, microbatch, name, kind, start_ns, end_ns, source, None, None)
        tr.buffers["spans"].add(row + (nbytes, direction, stream))
    except Exception as e:
        tr.fail(e)


def record_work(
    kind: str,
    value: int,
    *,
    key: int = -1,
    microbatch: int | None = None,
    group: str = "",
    seq: int = -1,
) -> None:
    """The work this rank was given (a ``work`` row, docs/spec.md §2): ``kind`` one of
    :data:`tracer.schema.WORK_KINDS` or a user's name, ``value`` its amount, ``key`` what it is
    of (an expert, a peer; -1 for none). In the current step, and in the innermost span's
    microbatch unless ``microbatch`` is given. Costs a tuple append; nothing when not attached."""
    tr = _STATE.tracer
    if tr is None or not tr.enabled:
        return
    try:
        mb = tr.mb if microbatch is None else microbatch
        tr.buffers["work"].add((tr.step_no, mb, kind, int(key), int(value), group, int(seq)))
    except Exception as e:
        tr.fail(e)


def spanned(
    name: str | Callable[..., Any] | None = None, kind: str = "compute", microbatch: int = -1
) -> Any:
    """Decorator form of :func:`span`; the span's name defaults to the function's."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        label = name if isinstance(name, str) else fn.__qualname__

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with span(label, kind, microbatch):
                return fn(*args, **kwargs)

        return inner

    if callable(name):
        return decorate(name)
    return decorate


def step(n: int) -> None:
    """Step ``n`` begins (heartbeat row, flush policy, watchdog progress)."""
    tr = _STATE.tracer
    if tr is not None and tr.enabled:
        try:
            if tr.auto is not None and tr.auto.steps:
                tr.auto.yield_steps()  # the script numbers its own steps
            tr.step(n)
        except Exception as e:
            tr.fail(e)


def attach(
    run_dir: str | os.PathLike[str],
    *,
    mesh: Mapping[str, int] | None = None,
    groups: Mapping[str, Any] | None = None,
    config: TracerConfig | None = None,
    auto: bool = True,
) -> Tracer:
    """Attach the tracer to this rank (after ``init_process_group``); idempotent.

    Collective: every rank must call it, since the clock estimate exchanges messages with rank
    0 over a dedicated gloo group. ``mesh`` ({"dp":..,"pp":..,"tp":..,"cp":..}) gives each
    rank's coordinates; ``groups`` names process groups ({"tp": pg}) for the ``group``
    column. Without them the tracer learns both from the script (tracer.meshinfo: a
    DeviceMesh, DDP, named ``new_group`` calls; until then dp = world). ``auto`` records steps
    and forward/backward/optimizer/data spans without code changes (tracer.autospans; an
    explicit ``step`` or span of those names turns it off). A problem with the run directory
    turns tracing off with one warning and returns a disabled tracer; a mesh that does not
    match the world raises.
    """
    if _STATE.tracer is not None and not _STATE.tracer.closed:
        return _STATE.tracer
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("tracer.attach: call torch.distributed.init_process_group first")
    rank, world = dist.get_rank(), dist.get_world_size()
    learn = mesh is None and groups is None
    mesh = dict(mesh or {"dp": world})
    size = 1
    for k in ("dp", "pp", "tp", "cp"):
        size *= int(mesh.get(k, 1))
    if size != world:
        raise ValueError(f"tracer.attach: mesh {mesh} has {size} ranks, the world has {world}")
    cfg = TracerConfig.from_env(config)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    tr = Tracer(str(run_dir), rank=rank, world=world, local_rank=local_rank, mesh=mesh, config=cfg)
    clock_pg = _clock_group(cfg, rank) if cfg.clock_sync and world > 1 else None
    _STATE.tracer = tr
    tr.after_hang = _exit_after_hang
    try:
        with tr.budget.part("start"):
            _start(tr, clock_pg, groups or {}, learn=learn, auto=auto)
        tr.budget.started()
    except Exception as e:
        tr.fail(e, "attaching")
    _install_exit_handlers()
    return tr


def _clock_group(cfg: TracerConfig, rank: int) -> Any:
    """The tracer's own gloo group, for the clock's round trips (collective: attach makes it
    before anything that can fail). A rank that fails here, or never attaches, would hold the
    others inside ``new_group`` for the groups' timeout (30 minutes on gloo): they wait
    ``attach_timeout_s`` at most, then trace on with their own host's clock."""
    import datetime

    import torch.distributed as dist

    try:
        timeout = datetime.timedelta(seconds=cfg.attach_timeout_s)
        return dist.new_group(backend="gloo", timeout=timeout)
    except Exception as exc:
        log.warning(
            "megascope: rank %d: the tracer's clock group did not form (%s: %s); its "
            "timestamps stay on this host's clock",
            rank,
            exc.__class__.__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
        )
        return None


def _start(
    tr: Tracer, clock_pg: Any, groups: Mapping[str, Any], *, learn: bool, auto: bool
) -> None:
    """Everything of attach after the collective part, in this order: the clock and the run
    directory, the capture of collectives, the automatic spans, the threads."""
    world_name = _prepare(tr, clock_pg, learn)
    if world_name is None:
        return
    if tr.config.capture_collectives:
        _start_capture(tr, clock_pg, groups, world_name, learn)
    _close_before_destroy(tr)
    if auto:
        from tracer.autospans import AutoSpans

        spans = AutoSpans(tr)
        tr.auto = spans
        spans.install()
    _start_threads(tr)


def _prepare(tr: Tracer, clock_pg: Any, learn: bool) -> str | None:
    """The device, the first clock estimate, the run directory with this rank's topology (and
    the CUDA timer): the default group's name, None where the directory cannot be written."""
    import torch
    import torch.distributed as dist

    cfg = tr.config
    if torch.cuda.is_available() and dist.get_backend() != "gloo":
        tr.device = "cuda"
    if clock_pg is not None:
        tr.sync_clock(clock_pg)
    try:
        os.makedirs(tr.run_dir, exist_ok=True)
        # A script's default group is "world" until DDP or a DeviceMesh says what it is.
        world_name = "world" if learn or tr.mesh["dp"] != tr.world else "dp"
        write_topology_and_run_json(tr, world_name if learn else None)  # pid on disk: see launcher
    except OSError as e:
        tr.fail_writing(e, tr.run_dir)
        return None
    if tr.device == "cuda" and cfg.cuda_events:
        from tracer.clock import CudaTimer

        tr.timer = CudaTimer(cfg.event_pool)
    return world_name


def _start_capture(
    tr: Tracer, clock_pg: Any, groups: Mapping[str, Any], world_name: str, learn: bool
) -> None:
    """The collective recorder, its Flight Recorder reader, DDP's comm hook on a CPU rank and,
    where attach was given no mesh, the watch of the groups the script makes."""
    import torch.distributed.distributed_c10d as c10d

    from tracer import flight
    from tracer.collectives import Recorder

    cfg = tr.config
    names = {pg: name for name, pg in groups.items() if pg is not None}
    recorder = Recorder(tr, tr.rank, names, world_name)
    tr.recorder = recorder
    if flight.available():
        skip = ({clock_pg} if clock_pg is not None else set()) | UNTRACED_GROUPS
        if tr.device == "cuda" and cfg.nccl_timing:
            os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # groups made later
            flight.enable_nccl_timing([pg for pg in c10d._world.pg_names if pg not in skip])
        recorder.flight = flight.FlightReader(recorder.group_of, tr.step_clock.step_at, skip=skip)
    recorder.install()
    if tr.device == "cpu" and cfg.ddp_comm_hook:  # DDP's reducer on the host: timed
        from tracer.ddpcomm import DdpComm

        ddp = DdpComm(tr, recorder)
        ddp.install()
        tr.restore.append(ddp.uninstall)
    if cfg.funcol_waits:  # DTensor's functional collectives: their waits, in eager mode
        from tracer.funcol import FuncolTimer

        funcol = FuncolTimer(recorder)
        if funcol.install():
            tr.restore.append(funcol.uninstall)
    if learn:
        from tracer.meshinfo import GroupWatch

        watch = GroupWatch(tr, recorder)
        tr.groups = watch
        watch.install(world_name)


def _start_threads(tr: Tracer) -> None:
    """The NVML sampler (a CUDA rank), the flusher and the watchdog."""
    import torch

    from tracer.watchdog import Watchdog
    from tracer.writer import Flusher, preload

    cfg = tr.config
    if tr.device == "cuda" and cfg.nvml_hz > 0:
        from tracer import nvml

        handle = nvml.open_device(torch.cuda.current_device())
        if handle is not None:
            tr.sampler = nvml.Sampler(
                handle, cfg.nvml_hz, tr.buffers["gpu"].add, cost=lambda: tr.budget.part("nvml")
            )
    preload()
    budget = tr.budget
    tr.flusher = Flusher(tr.flush_safely, lambda: budget.flush_every_s, name="megascope-flusher")
    trigger = os.path.join(tr.run_dir, cfg.stacks_file) if cfg.stacks_file else None
    tr.watchdog = Watchdog(
        tr.last_progress,
        tr.on_hang,
        tr.on_request,
        _terminate_from_watchdog,
        hang_timeout_s=cfg.hang_timeout_s,
        trigger_path=trigger,
        use_signal=cfg.stacks_on_signal,
        cost=lambda: tr.budget.part("watchdog"),
    )


def _close_before_destroy(tr: Tracer) -> None:
    """``destroy_process_group()`` ends the run: close first, while the groups (and Flight
    Recorder's entries of them) can still be read. Destroying one subgroup flushes first."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        if _STATE.tracer is tr and not tr.closed:
            if group is None or group is c10d._get_default_group():
                close()
            else:
                tr.flush_safely()
        return original(group)

    name = "destroy_process_group"
    for module in (dist, c10d):
        if getattr(module, name, None) is original:
            setattr(module, name, destroy_process_group)
    tr.restore.append(lambda: _restore(original, destroy_process_group))


def _restore(original: Any, ours: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for module in (dist, c10d):
        if getattr(module, original.__name__, None) is ours:
            setattr(module, original.__name__, original)


def close(status: str | None = None) -> None:
    """Flush everything and detach (idempotent; a second caller waits for the first).

    ``status`` goes to run.json when this tracer wrote it (default: "failed" after an uncaught
    exception, else "finished"). A SIGTERM arriving while closing waits for the close to end.
    """
    with _STATE.close_lock:
        tr = _STATE.tracer
        if tr is None or tr.closed:
            return
        tr.closed = True
        _STATE.closing_thread = threading.get_ident()
        try:
            finish(tr, status or exit_status())
        finally:
            _STATE.tracer = None
            _STATE.closing_thread = None
    if _STATE.term_pending:
        _STATE.term_pending = False
        _chain_sigterm(signal.SIGTERM, None)


def _install_exit_handlers() -> None:
    """atexit, and SIGTERM chained to the handler that was there before (main thread only)."""
    if _STATE.handlers:
        return
    _STATE.handlers = True
    atexit.register(close)
    os.register_at_fork(after_in_child=_detach_in_child)
    if threading.current_thread() is not threading.main_thread():
        return
    _STATE.sigterm_prev = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_sigterm)


def _detach_in_child() -> None:
    """A forked child (a DataLoader worker) has none of the tracer's threads: it records
    nothing, and its exit must not write the parent's rows."""
    tr = _STATE.tracer
    if tr is not None:
        tr.enabled = False
        tr.writing = False
        if tr.recorder is not None:
            tr.recorder.active = False
    _STATE.tracer = None
    _STATE.close_lock = threading.Lock()


def _on_sigterm(signum: int, frame: Any) -> None:
    if _STATE.closing_thread == threading.get_ident():
        _STATE.term_pending = True  # interrupted our own close (at exit): let it finish first
        return
    close(status="failed")
    _chain_sigterm(signum, frame)


def _terminate_from_watchdog() -> None:
    """SIGTERM seen by the watchdog thread. If the main thread does not start closing within
    a second (it is stuck in C code, where Python handlers cannot run), flush from here and
    exit with the status a SIGTERM would give (128 + 15)."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if _STATE.closing_thread is not None or _STATE.tracer is None:
            return
        time.sleep(0.05)
    log.warning("megascope: SIGTERM while the main thread is blocked; flushing and exiting")
    close(status="failed")
    os._exit(128 + signal.SIGTERM)


def _exit_after_hang() -> None:
    """The hang is on disk: give the other ranks time to record theirs, close, exit 3."""
    tr = _STATE.tracer
    grace = tr.config.hang_exit_grace_s if tr is not None else 0.0
    if tr is not None and tr.recorder is not None and tr.recorder.flight is not None:
        # What the hang left open stays open: once peers exit, gloo ends their collectives
        # in error, and Flight Recorder would report them completed.
        tr.recorder.flight.active = False
    log.warning("megascope: ending this process in %.0f s: it is hung (exit_on_hang)", grace)
    time.sleep(max(0.0, grace))
    with contextlib.suppress(Exception):
        close(status="hung")
    os._exit(3)


def _chain_sigterm(signum: int, frame: Any) -> None:
    prev = _STATE.sigterm_prev
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
