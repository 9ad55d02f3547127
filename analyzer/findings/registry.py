"""The detectors, in the order they run, and everything derived from what they declare.

Each detector module ends with its ``DETECTOR`` (:class:`~analyzer.findings.detector.DetectorSpec`:
its name, ``detect`` and the kinds it emits, :mod:`analyzer.findings.detector`). This list is
the one place that names them; the kinds a report can hold, the persistent kinds, the
windows' measures, the fleet's culprits, the kinds that explain a regression and what fixing a
finding changes in the what-if replay are all read from it. Adding a kind of finding is one
module (its ``detect`` and its ``DETECTOR``) and one line here.
"""

from __future__ import annotations

import numpy as np

from analyzer.findings import (
    checkpoint_stall,
    data_stall,
    hang,
    hardware_imbalance,
    offload_stall,
    regression,
    slow_link,
    stage_imbalance,
    straggler,
    throttle,
    transient_stall,
)
from analyzer.findings.detector import Detector, Kind, Replay
from analyzer.findings.record import Finding

# in the order they run (the order of findings of equal severity, kind and ranks)
DETECTORS: tuple[Detector, ...] = (
    hang.DETECTOR,
    straggler.DETECTOR,
    slow_link.DETECTOR,
    data_stall.DETECTOR,
    transient_stall.DETECTOR,
    stage_imbalance.DETECTOR,
    hardware_imbalance.DETECTOR,
    throttle.DETECTOR,
    regression.DETECTOR,
    checkpoint_stall.DETECTOR,
    offload_stall.DETECTOR,
)

# every kind a finding can have (docs/spec.md §3), by name
KINDS: dict[str, Kind] = {k.name: k for d in DETECTORS for k in d.kinds}
FINDING_KINDS = tuple(KINDS)
# the kinds of a lasting fault of some ranks (slow in most steps)
PERSISTENT = tuple(k.name for k in KINDS.values() if k.persistent)
# a lasting fault's series for the windows' change point: the measure its ranks exceed in
MEASURE = {k.name: k.measure for k in KINDS.values() if k.measure is not None}
# kinds whose ranks are the culprits a fleet counts per host
CULPRIT_KINDS = tuple(k.name for k in KINDS.values() if k.culprit)
# kinds whose ranks' own work can lift every rank's step time (a regression's explanation)
EXPLAINING = tuple(k.name for k in KINDS.values() if k.explains)


def by_name(names: tuple[str, ...] | list[str]) -> tuple[Detector, ...]:
    """The detectors named, in the registry's order."""
    return tuple(d for d in DETECTORS if d.name in names)


def emitting(kinds: tuple[str, ...]) -> tuple[Detector, ...]:
    """The detectors that emit any of ``kinds``, in the registry's order."""
    return tuple(d for d in DETECTORS if any(k.name in kinds for k in d.kinds))


def fix_of(replay: Replay, f: Finding) -> np.ndarray | None:
    """What fixing ``f`` changes in the what-if replay: its kind's ``fix`` (None: unpriced)."""
    kind = KINDS.get(f["kind"])
    return kind.fix(replay, f) if kind is not None else None
