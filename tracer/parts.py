"""What the tracer's parts ask of each other, as protocols.

A :class:`tracer.core.Tracer` holds its parts (the collective recorder, the group watch, the
automatic spans, the watchdog and the NVML sampler), and they hold the Tracer. The parts
import torch and :mod:`tracer.core` does not, and no two modules of the package import each
other (the import contracts in pyproject.toml): so the Tracer holds its parts by what it asks
of them, written down here, and mypy checks every call against it. The parts themselves hold
the Tracer by its class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tracer.flight import FlightReader

# A process group: torch's ProcessGroup, or None for the default group (torch is not imported
# here: tracer.core runs without it).
Group = Any


class RecorderPart(Protocol):
    """The collective recorder (:class:`tracer.collectives.Recorder`)."""

    active: bool
    flight: FlightReader | None
    # rows of the async calls made while this is a list (tracer.ddpcomm: a comm hook's)
    collecting: list[list[Any]] | None

    def install(self) -> None:
        """Put the wrappers in place."""
        ...

    def uninstall(self) -> None:
        """Put the original functions back."""
        ...

    def group_of(self, group: Group) -> tuple[str, int, Group]:
        """(name, size, key) of a group."""
        ...

    def name_group(self, pg: Group, name: str) -> None:
        """Call ``pg`` ``name`` from now on."""
        ...

    def named(self, pg: Group) -> str | None:
        """The name given to ``pg``, None where none was."""
        ...

    def rename_rows(self, rows: list[tuple[Any, ...]], col: int = ...) -> list[tuple[Any, ...]]:
        """Buffered rows of a renamed group, under its new name."""
        ...

    def inflight_rows(self) -> list[tuple[Any, ...]]:
        """Rows not completed yet, with a null end."""
        ...


class GroupsPart(Protocol):
    """The watch of the mesh and the groups a script makes (:class:`tracer.meshinfo.GroupWatch`)."""

    def install(self, world_name: str) -> None:
        """Watch the functions that make groups."""
        ...

    def uninstall(self) -> None:
        """Stop watching."""
        ...

    def write_meta(self) -> None:
        """What was learnt, into run.json (rank 0)."""
        ...


class AutoPart(Protocol):
    """The steps and spans of a plain script (:class:`tracer.autospans.AutoSpans`)."""

    steps: bool
    spans: bool

    def install(self) -> None:
        """Put the hooks in place."""
        ...

    def uninstall(self) -> None:
        """Take the hooks away."""
        ...

    def yield_steps(self) -> None:
        """The script numbers its own steps: stop drawing them."""
        ...

    def yield_spans(self) -> None:
        """The script draws its own spans: stop drawing them."""
        ...


class Stoppable(Protocol):
    """A thread of the tracer's (the watchdog, the NVML sampler)."""

    def stop(self) -> None:
        """End the thread."""
        ...
