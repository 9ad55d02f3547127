"""Real storage faults for the tests: a small tmpfs (mounting needs root), filled or remounted
read-only while a training writes into it. No mock of any OS call."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
from collections.abc import Iterator

import pytest

OFF_LINE = re.compile(r"rank (\d+): (\w+) writer off at step -?\d+: cannot write (\S+) \((\w+):")
LOSS_LINE = re.compile(r"step (\d+) loss (\d+\.\d+)")


@contextlib.contextmanager
def tmpfs(path: str, size: str = "64m") -> Iterator[str]:
    """A tmpfs of ``size`` mounted at ``path`` for the block; skips the test where it cannot be
    mounted (not root, no mount permitted)."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                         capture_output=True, text=True)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill(path: str) -> int:
    """Fill the filesystem of ``path`` to the last byte (a file ``filler`` in it); bytes written."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            block = chunk[:size]
            while True:
                try:
                    written += f.write(block) or 0
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    return written


def remount_ro(path: str) -> None:
    """Remount the tmpfs at ``path`` read-only."""
    subprocess.run(["mount", "-o", "remount,ro", path], check=True, capture_output=True)


def losses(text: str) -> dict[int, str]:
    """The trainer's loss lines, ``step -> loss`` as printed."""
    return {int(m.group(1)): m.group(2) for m in LOSS_LINE.finditer(text)}


def off_lines(text: str) -> list[tuple[int, str, str, str]]:
    """Every writer's turn-off line: (rank, writer, path, errno name)."""
    return [(int(m.group(1)), m.group(2), m.group(3), m.group(4)) for m in OFF_LINE.finditer(text)]


def steps_logged(run: str) -> int:
    """How many steps rank 0 has logged into ``RUN/.progress/steps.jsonl`` so far."""
    try:
        with open(os.path.join(run, ".progress", "steps.jsonl"), encoding="utf-8") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0
