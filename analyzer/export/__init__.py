"""Exporters: a run directory in other tools' formats.

* :mod:`analyzer.export.chrome` writes Chrome trace-event JSON (Perfetto, chrome://tracing).
"""
