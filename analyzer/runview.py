"""What the modules that build an opened run's tables need of it (:class:`RunView`).

analyzer/db.py's ``Run`` is the one implementation. The digests (analyzer/digests.py) and the
membership tables (analyzer/membership.py) are made while ``open_run`` builds a ``Run``, so they
take it by this description rather than importing analyzer/db.py, which imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import duckdb
import pandas as pd

T = TypeVar("T")


class RunView(Protocol):
    """An opened run, as its digests and membership tables read it."""

    path: str
    meta: dict[str, Any]
    con: duckdb.DuckDBPyConnection
    parts: dict[str, int]

    @property
    def world_size(self) -> int:
        """run.json's ``world_size``."""
        ...

    def execute(self, text: str, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """Run ``text`` with ``params`` bound; returns a DataFrame."""
        ...

    def create_table(self, name: str, text: str) -> None:
        """``create or replace table name as text``."""
        ...

    def has_rows(self, table: str) -> bool:
        """Whether ``table`` has a readable part."""
        ...

    def rank_files(self, table: str, ranks: Iterable[int]) -> list[str]:
        """The readable parts of ``table`` that hold rows of ``ranks``."""
        ...

    def retrying(self, fn: Callable[[], T]) -> T:
        """``fn()``, run again after each unreadable part it meets is left out."""
        ...
