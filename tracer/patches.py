"""What the tracer puts in place of torch's own functions and methods, and puts back.

The collective wrappers (tracer/collectives.py), DDP's comm hook (tracer/ddpcomm.py) and the
functional collectives' timing (tracer/funcol.py) each replace attributes of a module or class
at attach and restore them at close, but only where their replacement is still in place (a
wrapper someone installed over ours stays, and keeps calling ours).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def dressed(wrapper: Callable[..., Any], fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``wrapper`` under the name and docstring of the function it wraps (``name`` where that
    has none), with ``__wrapped__`` pointing at it."""
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(fn, "__name__", name)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    return wrapper


class Patches:
    """Attributes replaced on their owners (modules or classes), to be put back."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, ours)

    def __len__(self) -> int:
        return len(self._saved)

    def put(self, owner: Any, name: str, fn: Callable[..., Any], ours: Callable[..., Any]) -> None:
        """Set ``owner.name`` to ``ours`` (dressed as ``fn``), remembering ``fn``."""
        dressed(ours, fn, name)
        self._saved.append((owner, name, fn, ours))
        setattr(owner, name, ours)

    def restore(self) -> None:
        """Put each original back, last replaced first, where ours is still in place."""
        for owner, name, fn, ours in reversed(self._saved):
            if vars(owner).get(name) is ours:
                setattr(owner, name, fn)
        self._saved.clear()
