"""Which runs the dashboard serves, and the guard that keeps the run picker inside them.

The dashboard serves either one run directory (it holds run.json) or a folder of runs (its
direct subfolders holding run.json). A run name from the browser is only ever looked up in
the list found on the server; it is then resolved (symlinks followed) and must still lie
inside the served folder, so ``..``, absolute paths and links pointing out are refused.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dashboard.source import RunSource

SINGLE = "."  # the run name of a single-run dashboard


class RunPathError(ValueError):
    """A run name the dashboard will not serve (one line)."""


def _is_run(path: Path) -> bool:
    return (path / "run.json").is_file()


class RunRegistry:
    """The served runs by name, each opened lazily once and kept for the app's lifetime."""

    def __init__(self, run_or_root: str) -> None:
        root = Path(run_or_root).expanduser()
        if not root.exists():
            raise RunPathError(f"{run_or_root}: no such directory")
        if not root.is_dir():
            raise RunPathError(f"{run_or_root}: not a directory")
        self.root = root.resolve()
        self.single = _is_run(self.root)
        if not self.single and not self.names():
            raise RunPathError(
                f"{run_or_root}: neither a run directory (no run.json) nor a folder of runs"
            )
        self._sources: dict[str, RunSource] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The runs on offer: ``["."]`` for one run, else the subfolders holding run.json."""
        if _is_run(self.root):
            return [SINGLE]
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except OSError:
            return []
        return [
            e.name
            for e in entries
            if e.is_dir() and _is_run(Path(e.path)) and self._inside(Path(e.path))
        ]

    def _inside(self, path: Path) -> bool:
        resolved = path.resolve()
        return resolved == self.root or self.root in resolved.parents

    def resolve(self, name: object) -> Path:
        """The directory of run ``name``; RunPathError unless it is a served run inside root."""
        if not isinstance(name, str) or name not in self.names():
            raise RunPathError(f"unknown run {name!r}")
        path = self.root / name
        if not self._inside(path):  # checked again: a link may have changed since listing
            raise RunPathError(f"run {name!r} lies outside the served folder")
        return path.resolve()

    def get(self, name: object) -> RunSource:
        """The opened run ``name`` (checked by :meth:`resolve`)."""
        path = self.resolve(name)
        with self._lock:
            src = self._sources.get(str(path))
            if src is None:
                src = RunSource(str(path))
                self._sources[str(path)] = src
            return src
