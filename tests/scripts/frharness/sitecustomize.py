"""Test harness: Flight Recorder dumps and faults inside collectives, for real training ranks.

Put this folder on ``PYTHONPATH`` (``megascope train`` passes its environment on to torchrun's
workers) and set ``MEGASCOPE_FR_DIR``: every worker process (one that torchrun started: it has
``TORCHELASTIC_RUN_ID`` and ``RANK``) then

* dumps its Flight Recorder every ``MEGASCOPE_FR_EVERY`` seconds (default 0.25) into
  ``MEGASCOPE_FR_DIR`` as ``rank_R.json`` (``MEGASCOPE_FR_FORMAT=json``, the default) or
  ``_dump_R`` (``pickle``), rewritten atomically, from a daemon thread: the last dump a rank
  leaves is its state when it stopped (a rank that holds the GIL or is frozen leaves the one
  from just before);
* stops dumping once nothing changed in its buffer for ``MEGASCOPE_FR_STALL`` seconds (3) after
  training began, as NCCL's watchdog dumps on its timeout, before the job is torn down;
* stops dumping at the first error (an exception logged with its traceback, or uncaught: gloo
  soon marks the failed work retired, which a later dump would show), and else dumps once more
  at exit (normal, or ``os._exit``: the trainer's way out after a SIGTERM or an injected
  crash), so its last dump shows where it stopped, as NCCL's watchdog dumps on a failure;
* with ``MEGASCOPE_FR_FAULT=KIND:rank=R,call=N``, acts at rank R's N-th collective call on its
  tensor-parallel group (``MEGASCOPE_FR_TP`` consecutive ranks): ``gil`` starts a thread that
  takes the GIL for good 20 ms later (the rank freezes wherever it then is), ``kill`` enters
  it (async) and SIGKILLs itself, ``stop`` enters it and SIGSTOPs itself (frozen inside it).

Nothing happens in other processes (the launcher, torchrun, pytest).
"""

from __future__ import annotations

import atexit
import os
import sys

_DIR = os.environ.get("MEGASCOPE_FR_DIR")
MIN_ENTRIES = 30  # a stall counts once training runs (building the model makes none)
_WORKER = bool(os.environ.get("TORCHELASTIC_RUN_ID")) and "RANK" in os.environ


def _dump_path(rank: int) -> str:
    fmt = os.environ.get("MEGASCOPE_FR_FORMAT", "json")
    name = f"rank_{rank}.json" if fmt == "json" else f"_dump_{rank}"
    return os.path.join(_DIR, name)


def _dumper(rank: int) -> None:
    import hashlib
    import time

    every = float(os.environ.get("MEGASCOPE_FR_EVERY", "0.25"))
    stall = float(os.environ.get("MEGASCOPE_FR_STALL", "3"))
    fmt = os.environ.get("MEGASCOPE_FR_FORMAT", "json")
    path = _dump_path(rank)
    last, since = b"", time.monotonic()
    while not _FROZEN:
        time.sleep(every)
        if _FROZEN:
            return
        try:
            # never import here: the main thread may be importing torch right now
            dist = sys.modules.get("torch.distributed")
            if dist is None or not getattr(dist, "is_initialized", lambda: False)():
                continue
            c10d = sys.modules["torch._C._distributed_c10d"]

            data = (
                c10d._dump_fr_trace_json(True, False)
                if fmt == "json"
                else c10d._dump_fr_trace(True, False, False)
            )
            digest = hashlib.sha1(data).digest()
            if digest != last:
                last, since = digest, time.monotonic()
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            # the watchdog's timeout: nothing new for a while once training runs
            if time.monotonic() - since > stall and data.count(b"record_id") >= MIN_ENTRIES:
                _FROZEN.append(True)
        except Exception:  # the process is going down
            continue


def _dump_now(rank: int) -> None:
    """One dump now, from the calling thread (never raises)."""
    fmt = os.environ.get("MEGASCOPE_FR_FORMAT", "json")
    try:
        c10d = sys.modules["torch._C._distributed_c10d"]
        data = (
            c10d._dump_fr_trace_json(True, False)
            if fmt == "json"
            else c10d._dump_fr_trace(True, False, False)
        )
        path = _dump_path(rank)
        with open(f"{path}.tmp", "wb") as f:
            f.write(data)
        os.replace(f"{path}.tmp", path)
    except Exception:
        pass


_FROZEN = []  # set at the first error: later dumps would show the failed work retired


def _last_dump(rank: int) -> None:
    """A dump now, unless an error froze them."""
    if _FROZEN:
        return
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "is_initialized", lambda: False)():
        _dump_now(rank)


def _dump_at_exit(rank: int) -> None:
    """The last dump: the one before the first error (an exception logged or uncaught; gloo
    soon marks a failed work retired, which a later dump would show), else one at exit
    (normal, or ``os._exit``: the trainer's way out after a SIGTERM or an injected crash)."""
    import logging

    class _OnError(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info:
                _FROZEN.append(True)

    logging.getLogger().addHandler(_OnError(level=logging.ERROR))
    hook = sys.excepthook

    def _excepthook(*args: object) -> None:
        _FROZEN.append(True)
        hook(*args)

    sys.excepthook = _excepthook
    real_exit = os._exit

    def _exit(code: int) -> None:
        _last_dump(rank)
        real_exit(code)

    os._exit = _exit
    atexit.register(_last_dump, rank)


def _hold_gil() -> None:
    import ctypes
    import time

    time.sleep(0.02)
    ctypes.PyDLL(None).sleep(100000)  # libc sleep, called with the GIL held


def _install_fault(rank: int) -> None:
    spec = os.environ.get("MEGASCOPE_FR_FAULT", "")
    if not spec:
        return
    kind, _, rest = spec.partition(":")
    args = dict(kv.split("=") for kv in rest.split(",") if kv)
    if int(args["rank"]) != rank:
        return
    target = int(args["call"])
    tp = int(os.environ.get("MEGASCOPE_FR_TP", "2"))
    import signal
    import threading
    import time

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    count = [0]

    def is_tp(group) -> bool:
        if group is None:
            return False
        ranks = dist.get_process_group_ranks(group)
        return len(ranks) == tp and ranks == list(range(ranks[0], ranks[0] + tp))

    def wrap(fn):
        def wrapper(*a, **kw):
            if not is_tp(kw.get("group")):
                return fn(*a, **kw)
            count[0] += 1
            if count[0] != target:
                return fn(*a, **kw)
            if kind == "gil":  # another thread takes the GIL for good, wherever this one is
                threading.Thread(target=_hold_gil, daemon=True, name="gil-holder").start()
                return fn(*a, **kw)
            work = fn(*a, **{**kw, "async_op": True})
            time.sleep(0.3)  # the peers enter it too, and their dumpers see them wait
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            return work

        return wrapper

    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
        wrapped = wrap(getattr(dist, name))
        setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)


if _DIR and _WORKER:
    import threading

    _rank = int(os.environ["RANK"])
    os.makedirs(_DIR, exist_ok=True)
    threading.Thread(target=_dumper, args=(_rank,), daemon=True, name="fr-dumper").start()
    _dump_at_exit(_rank)
    _install_fault(_rank)
