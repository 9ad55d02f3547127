"""What every tracker receives, and the one interface each implements (analyzer/trackers/)."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from analyzer.rank_steps import StepScores
from tracer.cliutil import UsageError

EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


@dataclass(frozen=True)
class TrackerTarget:
    """Where to log: the tracker, the user's run (TensorBoard log dir, MLflow run id, W&B run
    path) or None for a new one, the tracker's directory (TensorBoard's root of log dirs,
    MLflow's tracking URI or store, W&B's ``WANDB_DIR``), and the megascope run's id that names
    a new run."""

    kind: str
    run: str | None
    dir: str | None
    name: str


@dataclass(frozen=True)
class FindingRecord:
    """A finding as a tracker logs it: kind, ranks, severity, first (onset) and last step."""

    kind: str
    ranks: tuple[int, ...]
    severity: float
    onset_step: int | None
    last_step: int | None
    message: str

    @classmethod
    def from_report(cls, f: Mapping[str, Any]) -> FindingRecord:
        """From a finding of the report (``findings``) or of a windows timeline (``first_step``,
        ``last_step``, ``max_severity``)."""
        steps = f.get("steps")
        first = f.get("first_step", steps[0] if steps else None)
        last = f.get("last_step", steps[-1] if steps else None)
        sev = f.get("severity", f.get("max_severity"))
        return cls(
            kind=str(f["kind"]),
            ranks=tuple(int(r) for r in f.get("ranks") or ()),
            severity=float(sev) if sev is not None else 0.0,
            onset_step=int(first) if first is not None else None,
            last_step=int(last) if last is not None else None,
            message=str(f.get("message", "")),
        )

    @property
    def key(self) -> str:
        """A metric-name-safe key of the finding: ``straggler/ranks_5`` (``ranks_none``)."""
        ranks = "_".join(map(str, self.ranks[:8])) or "none"
        if len(self.ranks) > 8:
            ranks += f"_and_{len(self.ranks) - 8}_more"
        return f"{re.sub(r'[^A-Za-z0-9_]', '_', self.kind)}/ranks_{ranks}"

    def as_dict(self) -> dict[str, Any]:
        """The record as plain JSON-able values."""
        d = asdict(self)
        d["ranks"] = list(self.ranks)
        return d


def findings_json(findings: list[FindingRecord]) -> str:
    """The findings as one JSON list (what the trackers store as text or an artifact)."""
    return json.dumps([f.as_dict() for f in findings], indent=1)


def missing_extra(kind: str) -> UsageError:
    """The one-line error for a tracker whose client library is not installed."""
    extra = EXTRAS[kind]
    return UsageError(f"--log-to {kind} needs its client library: pip install 'megascope[{extra}]'")


class Tracker(ABC):
    """A run of an experiment tracker that megascope logs into."""

    where: str = ""  # where the run is, for one line on stderr

    @abstractmethod
    def log_steps(self, rows: list[StepScores]) -> None:
        """Per step: each rank's straggler score and the step's exposed communication."""

    @abstractmethod
    def log_findings(
        self, findings: list[FindingRecord], step: int, new: list[FindingRecord]
    ) -> None:
        """The findings active at ``step`` (all of them, possibly none); ``new``: those not
        logged before, whose severity is logged at their onset step."""

    @abstractmethod
    def close(self) -> None:
        """Flush, and end the run where megascope began it (never the user's own run)."""
