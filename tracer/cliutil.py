"""Command-line helpers shared by every part: one-line errors, never a traceback.

Torch-free, so ``megascope analyze`` starts fast on a machine without torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn


class UsageError(Exception):
    """Unusable input. The CLI prints ``megascope: error: <message>`` and exits 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` alone and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def log_warnings() -> None:
    """Print the library's warnings (a part left out, a view not made) as one line each,
    ``megascope: warning: <message>``, unless the program set up logging itself."""
    logging.basicConfig(level=logging.WARNING, format="megascope: warning: %(message)s")


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """A ``--steps A:B`` range, inclusive; ``A:`` and ``:B`` leave one end open (from step 0,
    to the last). None when not given; else a :class:`UsageError`."""
    if text is None or not text.strip():
        return None
    lo, sep, hi = text.partition(":")
    try:
        a = int(lo) if lo.strip() else 0
        b = int(hi) if hi.strip() else 2**31 - 1
    except ValueError:
        raise UsageError(f"--steps {text!r}: expected A:B with integer steps") from None
    if not sep or a > b:
        raise UsageError(f"--steps {text!r}: expected A:B with A <= B")
    return a, b


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and exit."""
    first = str(message).strip().splitlines()[0] if str(message).strip() else "error"
    print(f"megascope: error: {first}", file=sys.stderr)
    raise SystemExit(code)


def write_out(path: str, text: str) -> None:
    """Write a command's ``--out`` file; a path that cannot be written is a usage error."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"--out {path}: {e.strerror or e}") from None
