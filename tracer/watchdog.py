"""Hang watchdog and stack dumps (py-spy) for one rank.

The watchdog thread wakes a few times per ``hang_timeout``. When the rank has made no progress
(no step began, no collective completed) for longer than the timeout, it calls the tracer's
``on_hang`` once (the tracer records the state, the collectives in flight with a null end, a
py-spy dump of its own process, and flushes); progress re-arms it. It never kills anything:
ending the run is the launcher's decision.

Stacks on demand, while the main thread is stuck in C code (a collective, a sleep):

* a signal (SIGUSR1 by default). A Python-level handler would only run once the main thread
  gets back to bytecode, so the tracer points ``signal.set_wakeup_fd`` at a socket pair: the
  C-level handler writes the signal number there from whichever thread the kernel picked, and
  the watchdog thread, waiting in ``select`` on the other end, takes the dump. (If the program
  already uses the wakeup fd, e.g. an asyncio loop, the signal route is left off.)
* a trigger file in the run directory (``dump-stacks``): touching it asks every rank that sees
  the file change for a dump (this also works across hosts on a shared file system).

A rank stuck *holding the GIL* cannot run this thread; the launcher covers it with an external
py-spy, using the pid written to ``topology`` at attach.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

STACK_SIGNAL = signal.SIGUSR1


def _pyspy() -> str | None:
    near = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return near if os.access(near, os.X_OK) else shutil.which("py-spy")


def parse_pyspy(text: str) -> list[tuple[str, str]]:
    """``py-spy dump`` output as (thread, stack) pairs, one per ``Thread ...`` block."""
    threads: list[tuple[str, str]] = []
    header: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("Thread "):
            if header is not None:
                threads.append((header, "\n".join(lines)))
            header, lines = line[len("Thread ") :].strip(), []
        elif header is not None and line.strip():
            lines.append(line.strip())
    if header is not None:
        threads.append((header, "\n".join(lines)))
    return threads


def python_stacks() -> list[tuple[str, str]]:
    """The fallback without py-spy: every thread's Python stack from inside the process."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame)).strip()
        out.append((f'{ident}: "{names.get(ident, "?")}"', stack))
    return out


def dump_own_stacks(timeout_s: float = 30.0) -> list[tuple[str, str]]:
    """(thread, stack) of every thread of this process: py-spy when present, else Python's."""
    exe = _pyspy()
    if exe is not None:
        try:
            done = subprocess.run(
                [exe, "dump", "--pid", str(os.getpid())],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            threads = parse_pyspy(done.stdout)
            if threads:
                return threads
            log.info("py-spy dump gave nothing (%s); using Python stacks", done.stderr.strip())
        except (OSError, subprocess.SubprocessError) as exc:
            log.info("py-spy dump failed (%s); using Python stacks", exc)
    return python_stacks()


class Watchdog:
    """The per-rank thread behind hang detection and stacks on demand.

    ``progress()`` returns the ``time.monotonic()`` of the last progress (None: not armed).
    ``on_hang(idle_s)``, ``on_request()`` and ``on_terminate()`` (a SIGTERM arrived: the
    C-level handler writes it to the wakeup fd too) are the tracer's callbacks.
    """

    def __init__(
        self,
        progress: Callable[[], float | None],
        on_hang: Callable[[float], None],
        on_request: Callable[[], None],
        on_terminate: Callable[[], None] | None = None,
        *,
        hang_timeout_s: float,
        trigger_path: str | None,
        use_signal: bool,
        cost: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        self._progress = progress
        self._cost = cost or contextlib.nullcontext
        self._on_hang = on_hang
        self._on_request = on_request
        self._on_terminate = on_terminate
        self._timeout = hang_timeout_s
        self._trigger = trigger_path
        self._trigger_mtime = self._mtime()
        self._stop = threading.Event()
        self._rsock: socket.socket | None = None
        self._wsock: socket.socket | None = None
        self._prev_fd: int | None = None
        self._prev_handler: Any = None
        if use_signal:
            self._install_signal()
        self._thread = threading.Thread(target=self._run, name="megascope-watchdog", daemon=True)
        self._thread.start()

    def _mtime(self) -> float:
        try:
            return os.stat(self._trigger).st_mtime if self._trigger else 0.0
        except OSError:
            return 0.0

    def _install_signal(self) -> None:
        """Route STACK_SIGNAL to this thread through the wakeup fd (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        prev = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        if prev != -1:  # somebody else's; leave it to them
            signal.set_wakeup_fd(prev)
            r.close()
            w.close()
            return
        previous = signal.getsignal(STACK_SIGNAL)

        def handler(signum: int, frame: Any) -> None:
            if callable(previous):
                previous(signum, frame)

        self._prev_handler = previous
        signal.signal(STACK_SIGNAL, handler)
        self._rsock, self._wsock, self._prev_fd = r, w, prev

    def _uninstall_signal(self) -> None:
        if self._wsock is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.set_wakeup_fd(-1) != self._wsock.fileno():
            log.debug("wakeup fd was replaced by the program; not restoring")
        signal.signal(STACK_SIGNAL, self._prev_handler or signal.SIG_DFL)

    def _poll(self) -> float:
        return min(1.0, self._timeout / 4) if self._timeout > 0 else 0.5

    def _signalled(self, timeout: float) -> bytes:
        """The signal numbers received while waiting up to ``timeout`` seconds."""
        if self._rsock is None:
            self._stop.wait(timeout)
            return b""
        ready, _, _ = select.select([self._rsock], [], [], timeout)
        if not ready:
            return b""
        try:
            return self._rsock.recv(64)
        except OSError:
            return b""

    def _run(self) -> None:
        reported = False
        while not self._stop.is_set():
            signals = self._signalled(self._poll())
            if self._stop.is_set():
                break
            if int(signal.SIGTERM) in signals and self._on_terminate is not None:
                self._on_terminate()
            with self._cost():
                reported = self._round(signals, reported)

    def _round(self, signals: bytes, reported: bool) -> bool:
        """One look: a stack request, a hang. Returns whether the current hang is reported."""
        asked = int(STACK_SIGNAL) in signals
        mtime = self._mtime()
        if mtime != self._trigger_mtime:
            self._trigger_mtime, asked = mtime, True
        try:
            if asked:
                self._on_request()
            last = self._progress()
            if self._timeout > 0 and last is not None:
                idle = time.monotonic() - last
                if idle > self._timeout and not reported:
                    reported = True
                    self._on_hang(idle)
                elif idle <= self._timeout:
                    reported = False
        except Exception as exc:  # the watchdog must not die silently mid-run
            log.warning("megascope watchdog: %s", exc)
        return reported

    def stop(self) -> None:
        """End the thread: wake it, give back the wakeup fd and the stack signal's handler (from the
        main thread), wait up to 5 s for it (unless called from it) and close the sockets."""
        self._stop.set()
        if self._wsock is not None:
            with contextlib.suppress(OSError):
                self._wsock.send(b"\0")  # wake the select now
        self._uninstall_signal()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        for s in (self._rsock, self._wsock):
            if s is not None:
                s.close()
