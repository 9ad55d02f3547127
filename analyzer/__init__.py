"""megascope's analyzer: DuckDB over a run directory, findings, importers, exporters, CLI.

Never imports torch: analysis runs where torch is absent.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

try:
    __version__ = _dist_version("megascope")  # one source: pyproject.toml's version
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
