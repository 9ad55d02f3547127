"""Trace a script without changing it: ``MEGASCOPE_TRACE=RUN python -m tracer.run script.py``.

With torchrun: ``MEGASCOPE_TRACE=RUN torchrun --nproc-per-node 4 -m tracer.run script.py ARGS``.

:func:`install_auto_attach` wraps ``torch.distributed.init_process_group`` (in both
``torch.distributed`` and ``distributed_c10d``) so that, right after the script's own call
returns, the tracer attaches to the run directory named by ``MEGASCOPE_TRACE`` (with the
``MEGASCOPE_*`` settings of tracer.config). The script then runs as ``__main__`` (a path, or
``-m module``), with its own ``sys.argv``. Without ``MEGASCOPE_TRACE`` the script just runs.

Only functions looked up after the wrap are traced: a script that did
``from torch.distributed import all_reduce`` before ``init_process_group`` keeps the untraced
function, since the tracer attaches (and wraps the collectives) only after that call.
"""

from __future__ import annotations

import functools
import logging
import os
import runpy
import sys
from typing import Any

from tracer.cliutil import ArgumentParser

log = logging.getLogger(__name__)
ENV = "MEGASCOPE_TRACE"


def install_auto_attach(run_dir: str | None = None) -> bool:
    """Attach right after ``init_process_group``; False when no run directory is set."""
    target = run_dir or os.environ.get(ENV)
    if not target:
        return False
    prepare_environment()
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = dist.init_process_group
    if getattr(original, "_megascope", False):
        return True

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            import tracer

            tracer.attach(target)
        except Exception as exc:  # tracing must never stop the script
            log.warning("megascope: could not attach the tracer: %s", exc)
        return result

    init_process_group._megascope = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group
    return True


def prepare_environment() -> None:
    """Settings the script's process groups read when they are created, so before them:
    Flight Recorder on (what DDP, FSDP and DTensor issue is read from it: tracer.flight),
    NCCL's own timing of every collective, and an end to a hung process (nothing else ends a
    plain torchrun job before its collective timeout). A value the user set is kept."""
    if not (
        os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    ):
        os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    os.environ.setdefault("MEGASCOPE_EXIT_ON_HANG", "1")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tracer.run``: run the script or module with the tracer attaching
    after ``init_process_group``; returns 0 once it returns."""
    parser = ArgumentParser(
        prog="python -m tracer.run",
        description="Run a script with the megascope tracer attached after init_process_group.",
    )
    parser.add_argument("--out", help=f"run directory (default: ${ENV})")
    parser.add_argument("-m", dest="module", help="run a module instead of a script")
    parser.add_argument("script", nargs="?", help="the script to run")
    parser.add_argument("args", nargs="...", help="its arguments")
    ns = parser.parse_args(argv)
    if not ns.module and not ns.script:
        parser.error("name a script or -m MODULE")
    run_dir = ns.out or os.environ.get(ENV)
    if not run_dir:
        parser.error(f"no run directory: pass --out RUN or set {ENV}")
    os.environ[ENV] = run_dir  # so that subprocesses of the script attach too
    install_auto_attach(run_dir)
    if ns.module:
        rest = [ns.script, *ns.args] if ns.script else list(ns.args)
        sys.argv = [ns.module, *rest]
        runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
    else:
        if not os.path.isfile(ns.script):
            parser.error(f"no such script: {ns.script}")
        sys.argv = [ns.script, *ns.args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
        runpy.run_path(ns.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
