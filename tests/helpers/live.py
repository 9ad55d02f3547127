"""What starts ranks: ``megascope train`` and a script under torchrun with the tracer attached.

Tests take these through the fixtures of ``tests/conftest.py`` (``train``, ``attach``,
``launch``), which mark them ``live``: ``pytest -m live`` runs them, the default tier does not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import duckdb

from helpers.net import free_port
from helpers.paths import EXAMPLES, ROOT

# what a healthy run must never raise, and what names a culprit
ALARMS = frozenset({"straggler", "slow_link", "hang", "crash"})
# the examples' former default size: a few ms a forward, which keeps the runs short; the factors
# the live tests inject stand out at it (bench/framework_accuracy.py runs the default size)
SMALL = ("--dim", "128", "--layers", "2", "--seq", "64")
# between the smallest and the default: a forward of a transformer block lasts longer than the
# scheduler's slices where 4 ranks share 2 cores
MID = ("--dim", "192", "--layers", "2", "--seq", "96")


def train(
    *args: str, timeout: float = 500, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``megascope train ARGS`` (torchrun and all) from the repository's root, to its end."""
    return subprocess.run(
        [sys.executable, "-m", "analyzer", "train", *args],
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def trained(out: str, *args: str, timeout: float = 500) -> str:
    """``megascope train ARGS --out OUT``, which must succeed; the run directory."""
    res = train(*args, "--out", out, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    return out


@dataclass(frozen=True)
class Demo:
    """A finished ``megascope demo --no-serve``: its run directory (which holds its
    findings.json and report.html) and what it printed."""

    run: str
    stdout: str
    stderr: str
    returncode: int


def run_demo(out: str, launch: Callable[..., subprocess.Popen]) -> Demo:
    """``megascope demo --no-serve --out OUT`` to its end, started through ``launch``."""
    proc = launch(
        [sys.executable, "-m", "analyzer", "demo", "--no-serve", "--out", out],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stdout, stderr = proc.communicate(timeout=600)
    return Demo(out, stdout, stderr, proc.returncode)


def torchrun_command(script: str, *args: str, nproc: int = 4) -> list[str]:
    """``torchrun -m tracer.run SCRIPT ARGS`` on loopback; SCRIPT is a path, or the name of one
    of examples/."""
    path = script if os.path.isabs(script) else os.path.join(EXAMPLES, script)
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", "-m", "tracer.run", path, *args]  # fmt: skip


def traced_env(run: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a traced script: MEGASCOPE_TRACE=run, the repository importable."""
    return {**os.environ, "MEGASCOPE_TRACE": run, "PYTHONPATH": ROOT, **(env or {})}


def attach(
    run: str,
    script: str,
    *args: str,
    nproc: int = 4,
    steps: int | None = 14,
    size: Sequence[str] = SMALL,
    timeout: float = 270,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """An example script (or any script by path), unmodified, traced into ``run`` under
    torchrun, to its end. ``steps`` and ``size`` are the examples' flags (None and () for a
    script that has neither)."""
    flags = [*(["--steps", str(steps)] if steps is not None else []), *size, *args]
    cmd = torchrun_command(script, *flags, nproc=nproc)
    return subprocess.run(
        cmd, cwd=ROOT, env=traced_env(run, env), capture_output=True, text=True, timeout=timeout
    )


def attach_popen(
    run: str, script: str, *args: str, nproc: int = 2, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """:func:`attach` started in a session of its own (so the test can end it all), its stdout
    and stderr merged."""
    return subprocess.Popen(
        torchrun_command(script, *args, nproc=nproc), cwd=ROOT, env=traced_env(run, env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True,
    )  # fmt: skip


def launch(cmd: Sequence[str], **kwargs) -> subprocess.Popen:
    """Any other process a live test starts (a launcher it signals, a node of a multi-node
    run), from the repository's root unless ``cwd`` says otherwise."""
    kwargs.setdefault("cwd", ROOT)
    return subprocess.Popen(list(cmd), **kwargs)


def wait_for(predicate: Callable[[], bool], timeout: float = 120.0, every: float = 0.2) -> bool:
    """Poll ``predicate`` every ``every`` s until it holds or ``timeout`` passes; whether it
    held. A look that read a live run's files as the tracer merged a table's parts (the merged
    file is renamed into place, then its parts removed: a file listed may be gone when it is
    opened) saw nothing yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except duckdb.IOException as e:
            if "No such file" not in str(e):
                raise
        time.sleep(every)
    return False
