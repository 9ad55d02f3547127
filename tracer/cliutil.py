"""Command-line helpers shared by every part: one-line errors, never a traceback.

Torch-free, so ``megascope analyze`` starts fast on a machine without torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class UsageError(Exception):
    """Unusable input. The CLI prints ``megascope: error: <message>`` and exits 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


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
