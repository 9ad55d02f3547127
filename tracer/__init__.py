"""megascope's tracer: per-rank timelines of compute spans and collectives, into Parquet.

The torch-free modules (schema, rundir, faults, cliutil) import nothing heavy; the public
tracing API is loaded on first use so that ``import tracer.schema`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = (
    "attach",
    "close",
    "current",
    "record_span",
    "record_work",
    "span",
    "spanned",
    "step",
    "Tracer",
)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("tracer.api"), name)
    raise AttributeError(f"module 'tracer' has no attribute {name!r}")


__all__ = list(_API)
