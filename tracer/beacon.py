"""What a rank's writers say about their storage, and the launcher's ear for it.

megascope's writers (the tracer's parts, the trainer's progress files, checkpoints) write into
the run directory. When that directory fails (full, read-only, gone, an I/O error), each writer
turns itself off with one line (:func:`off_line`) and the training goes on. Two things must
still reach the launcher, which reads nothing of the run directory it could trust any more:

* that a rank still progresses (its progress line), since the launcher takes a rank whose
  progress stands still for hung;
* which writer failed, on which path, with which error (run.json ``storage_failed``), and which
  checkpoints are missing.

They travel as small JSON datagrams to a UDP socket on 127.0.0.1 that the launcher binds
(:class:`Listener`) and names to its ranks in ``MEGASCOPE_BEACON`` (``host:port``). A datagram
is never waited for: the socket does not block, and one that cannot be sent is lost (the next
progress line replaces it). Without ``MEGASCOPE_BEACON`` (a script run by torchrun alone) the
:class:`Sender` sends nothing. Torch-free.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

ENV = "MEGASCOPE_BEACON"
MAX_DATAGRAM = 8192
# the storage faults a writer turns itself off on (any other OSError does the same)
STORAGE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO, errno.ENOENT, errno.EDQUOT)


@dataclass(frozen=True)
class StorageFailure:
    """One writer of one rank that turned itself off: which, where, why, and from which step."""

    rank: int
    writer: str  # "tracer", "progress", "checkpoint"
    path: str
    error: str  # "ENOSPC: No space left on device"
    step: int  # the last step the rank had begun when the write failed (-1: before the first)

    def as_dict(self) -> dict[str, Any]:
        """The run.json entry (``storage_failed``)."""
        return asdict(self)


def describe(exc: BaseException) -> str:
    """An OSError as ``ENOSPC: No space left on device`` (its errno's name and text); anything
    else as its class and first line."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
        return f"{name}: {exc.strerror or os.strerror(exc.errno)}"
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0]}" if text else exc.__class__.__name__


def failed_path(exc: BaseException, default: str) -> str:
    """The path an OSError names (the one that failed), else ``default``."""
    name = getattr(exc, "filename", None)
    return str(name) if name else default


def off_line(failure: StorageFailure) -> str:
    """The one line a writer prints when it turns itself off."""
    return (
        f"megascope: rank {failure.rank}: {failure.writer} writer off at step {failure.step}: "
        f"cannot write {failure.path} ({failure.error}); training goes on"
    )


class Sender:
    """A rank's side: datagrams to the launcher's :class:`Listener`, never blocking."""

    def __init__(self, address: str | None = None) -> None:
        address = os.environ.get(ENV) if address is None else address
        self._sock: socket.socket | None = None
        self._to: tuple[str, int] | None = None
        if not address:
            return
        host, _, port = address.rpartition(":")
        try:
            self._to = (host or "127.0.0.1", int(port))
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        except (OSError, ValueError):
            self._sock = None

    @property
    def active(self) -> bool:
        """Whether a launcher listens (``MEGASCOPE_BEACON`` was set and usable)."""
        return self._sock is not None

    def send(self, message: dict[str, Any]) -> None:
        """Send ``message`` as JSON; lost (never waited for) when it cannot go now."""
        if self._sock is None or self._to is None:
            return
        try:
            self._sock.sendto(json.dumps(message).encode()[:MAX_DATAGRAM], self._to)
        except OSError:
            pass

    def line(self, rank: int, raw: str) -> None:
        """Rank ``rank``'s progress line (``pid step ns state``)."""
        self.send({"rank": rank, "line": raw})

    def failure(self, failure: StorageFailure) -> None:
        """A writer turned itself off."""
        self.send({"rank": failure.rank, "storage_failed": failure.as_dict()})

    def checkpoint_missing(self, rank: int, steps_done: int, error: str) -> None:
        """The checkpoint after ``steps_done`` steps could not be written by ``rank``."""
        self.send({"rank": rank, "checkpoint_missing": steps_done, "error": error})


_SENDER: Sender | None = None


def sender() -> Sender:
    """This process's :class:`Sender` (made at first use from ``MEGASCOPE_BEACON``)."""
    global _SENDER
    if _SENDER is None:
        _SENDER = Sender()
    return _SENDER


def reset_sender() -> None:
    """Forget this process's :class:`Sender`: the next :func:`sender` is made again from
    ``MEGASCOPE_BEACON`` (a process whose environment changed)."""
    global _SENDER
    _SENDER = None


class Listener:
    """The launcher's side: a UDP socket on 127.0.0.1 (a free port), read without blocking."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, the value of ``MEGASCOPE_BEACON`` for the ranks."""
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def drain(self) -> list[dict[str, Any]]:
        """Every datagram that arrived since the last call (malformed ones are skipped)."""
        out: list[dict[str, Any]] = []
        while True:
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                return out
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if isinstance(msg, dict) and isinstance(msg.get("rank"), int):
                out.append(msg)

    def close(self) -> None:
        """Close the socket."""
        self._sock.close()
