"""The engine's instrumentation points.

The engine calls ``hooks.span("forward", "compute", mb)`` and ``hooks.span("backward",
"compute", mb)`` around each microbatch's forward and backward, and ``hooks.span("optimizer",
"compute")`` around the optimizer step (gradient reduction, clipping, update and parameter
gather). The per-rank training loop passes an implementation that opens a tracer span and
applies the compute faults there; the default, :class:`NullHooks`, does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable


@runtime_checkable
class Hooks(Protocol):
    """Anything with a ``span`` method returning a context manager."""

    def span(
        self, name: str, kind: str = "compute", microbatch: int = -1
    ) -> AbstractContextManager:
        """Wrap one region of work: ``name`` (``forward``, ``backward``, ``optimizer``),
        ``kind`` (``compute|comm|data|host``) and the microbatch index (-1 if none)."""
        ...


class NullHooks:
    """Hooks that do nothing."""

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute", microbatch: int = -1) -> Iterator[None]:
        """A span that records nothing."""
        yield


class RecordingHooks:
    """Hooks that remember the order of spans, ``(name, kind, microbatch)`` per entry, and
    which span is open now (``current``, None outside any). Useful in tests and for checking
    a schedule."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self.current: tuple[str, str, int] | None = None

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute", microbatch: int = -1) -> Iterator[None]:
        """Append ``(name, kind, microbatch)`` to ``events`` and make it ``current`` until the block
        ends."""
        outer, self.current = self.current, (name, kind, microbatch)
        self.events.append(self.current)
        try:
            yield
        finally:
            self.current = outer
