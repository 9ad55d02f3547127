"""Exporters: a run directory in other tools' formats.

* :mod:`analyzer.export.chrome` writes Chrome trace-event JSON (Perfetto, chrome://tracing).
* :mod:`analyzer.export.whatif` writes the trace schema of ByteDance Seed's what-if study.
"""
