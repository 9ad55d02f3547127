"""The records of the findings report (docs/spec.md §3): a :class:`Finding` and a :class:`Report`.

They are ``TypedDict``\\ s, not dataclasses, on purpose. A report is JSON: it is printed and
written (``megascope analyze --json``), read back by the dashboard and by ``compare`` from a
report.json, shipped from Dask workers, logged to trackers. A ``TypedDict`` is the plain dict
the JSON holds, so the bytes on disk and on stdout stay what they were (key order included:
``kind, ranks, coords, hosts, severity, steps, evidence, message``), a report read back is the
same record with no conversion to keep in step, and the type checker still knows every key of
a finding. Pricing sets a finding's severity and adds to its evidence in place, as before.

``evidence`` is each kind's own numbers (spec §3 lists them per kind): a free mapping. A note
(``notes``: run-level remarks that name no culprit) is a mapping of its own kind's fields.
"""

from __future__ import annotations

from typing import Any, TypedDict

# a finding's evidence: the numbers that convinced its detector (per kind, docs/spec.md §3)
Evidence = dict[str, Any]
# a run-level note (throttle, regression, dropped rows, layout, storage): its kind's fields
Note = dict[str, Any]


class Finding(TypedDict):
    """One finding of docs/spec.md §3, in the order its JSON gives the keys."""

    kind: str
    ranks: list[int]
    coords: list[dict[str, int]]
    hosts: list[str | None]
    severity: float
    steps: list[int]
    evidence: Evidence
    message: str


class RunInfo(TypedDict, total=False):
    """The report's ``run``: the world, the steps analyzed, and how severity was had."""

    world_size: int
    mesh: dict[str, int]
    steps: list[int]
    median_step_ms: float | None
    mfu: float | None
    severity: dict[str, Any]
    layout: dict[str, Any]


class Report(TypedDict):
    """The findings report of ``megascope analyze`` (docs/spec.md §3)."""

    schema: str
    run: RunInfo
    findings: list[Finding]
    dismissed: list[Finding]
    notes: list[Note]


class Window(TypedDict):
    """One window of ``analyze --windows K`` (docs/spec.md §3): its steps and findings."""

    steps: list[int]
    findings: list[Finding]
