"""What a detector declares: the seam between a detector module and everything that loops over
the detectors (:mod:`analyzer.findings.registry`).

A detector module holds its algorithm and, at its end, one :class:`DetectorSpec` (its
``DETECTOR``, a :class:`Detector`): its name, ``detect(ctx)``, and the :class:`Kind`\\ s of finding it emits, each
with what the rest of the analyzer needs to know of it:

* ``persistent``: a lasting fault of some ranks (slow in most steps); the steps since a late
  onset are analyzed again for it (:mod:`analyzer.findings.onset`), a transient stall of its
  ranks is explained by it, and the windows' timeline dates it;
* ``measure``: the per-(rank, step) column its ranks exceed their peers in (the windows'
  change point, :mod:`analyzer.windows`);
* ``culprit``: its ranks are the culprits a fleet counts per host (:mod:`analyzer.fleet`);
* ``explains``: its ranks' own work can lift every rank's step, so it may explain a
  regression (:mod:`analyzer.findings.regression`);
* ``fix``: what fixing it changes in the what-if replay (the operations set to their peers'),
  or None where it is not priced there (its severity stays the detector's estimate).

``fix`` takes the replay as a :class:`Replay` (the protocol that
:class:`analyzer.findings.severity.cost.Costs` meets), so a detector module never imports the
pricing, and the pricing never imports a detector.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from analyzer.findings.record import Finding

if TYPE_CHECKING:
    from analyzer.findings.common import Context


class Replay(Protocol):
    """The what-if replay's masks of operations, as a finding's ``fix`` asks for them."""

    def ranks_compute(self, ranks: list[int]) -> np.ndarray:
        """Mask of the compute slots of ``ranks``."""
        ...

    def stage_compute(self, stage: int) -> np.ndarray:
        """Mask of the compute slots of pipeline stage ``stage``."""
        ...

    def link(self, ends: list[int], groups: set[str]) -> np.ndarray:
        """Mask of the transfers that run between ``ends`` in the named groups."""
        ...

    def seen_excess(self, mask: np.ndarray) -> float:
        """Seconds per step by which the ``mask`` slots run over their peers' median."""
        ...


# what fixing a finding changes in the replay: its operations' mask, or None (not priced)
Fix = Callable[[Replay, Finding], "np.ndarray | None"]


def unpriced(replay: Replay, f: Finding) -> np.ndarray | None:
    """The ``fix`` of a kind the replay does not price: its severity is its detector's."""
    return None


@dataclass(frozen=True)
class Kind:
    """A kind of finding and what the analyzer does with it (module docstring)."""

    name: str
    persistent: bool = False
    measure: str | None = None
    culprit: bool = False
    explains: bool = False
    fix: Fix = unpriced


class Detector(Protocol):
    """What the registry and ``analyze`` ask of a detector."""

    @property
    def name(self) -> str:
        """The detector's name (progress lines, the registry's order)."""
        ...

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """The kinds of finding it emits, with what each means to the rest of the analyzer."""
        ...

    @property
    def detect(self) -> Callable[[Context], list[Finding]]:
        """Its findings over a context (docs/spec.md §3)."""
        ...


@dataclass(frozen=True)
class DetectorSpec:
    """One detector, as a module declares it (its ``DETECTOR``): a :class:`Detector`."""

    name: str
    detect: Callable[[Context], list[Finding]]
    kinds: tuple[Kind, ...]
