"""megascope's analyzer: DuckDB over a run directory, findings, importers, exporters, CLI.

Never imports torch: analysis runs where torch is absent.
"""
