"""Importers: traces written by other tools become megascope run directories.

* :mod:`analyzer.importers.kineto` reads PyTorch profiler (Kineto) traces, one per rank.
* :mod:`analyzer.importers.flight_recorder` reads PyTorch Flight Recorder dumps, one per rank.

Both write through :mod:`tracer.rundir` only, so what they produce is an ordinary run
directory (docs/spec.md §2) that ``megascope analyze`` and the dashboard read like any other.
Neither imports torch. Unusable input raises :class:`TraceError` with one line naming the file.
"""

from analyzer.importers.common import TraceError

__all__ = ["TraceError"]
