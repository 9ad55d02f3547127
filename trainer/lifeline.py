"""No rank outlives its launcher: the kernel's parent-death signal (Linux ``prctl``).

``megascope train`` starts torchrun in a session of its own (so that a Ctrl-C in the terminal
reaches the launcher alone, which then ends the run in order), and torchrun starts the ranks.
Killed with SIGKILL, or by the OOM killer, the launcher can end nothing, and torchrun and its
ranks would train on, holding their GPUs. So torchrun is asked for SIGTERM when the launcher
dies (torchrun then stops its workers as on any SIGTERM), and each rank for SIGKILL when
torchrun dies (nothing else would end it then). Elsewhere than Linux this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask the kernel for ``sig`` when this process's parent dies. ``parent``: the pid the
    caller expects as its parent; if it already died (the process was re-parented before the
    call), ``sig`` is sent at once. Returns whether the request was taken."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def child_setup(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process
    (the parent, whose pid is taken now) dies."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)
