"""TensorBoard: event files written by ``torch.utils.tensorboard.SummaryWriter`` (the
``tensorboard`` extra), into the user's log dir (``--tracker-run DIR``) or a new one,
``megascope-RUN_ID`` under ``--tracker-dir`` (default ``runs``, as SummaryWriter's)."""

from __future__ import annotations

import os

from analyzer.rank_steps import StepScores
from analyzer.trackers.base import (
    FindingRecord,
    Tracker,
    TrackerTarget,
    findings_json,
    missing_extra,
)


class TensorBoardTracker(Tracker):
    """Scalars ``megascope/straggler_score/rank_N`` and ``megascope/exposed_comm_ms`` per step,
    ``megascope/finding/KIND/ranks_N/severity`` at each finding's onset step, and the findings
    as JSON text ``megascope/findings`` at each step they change."""

    def __init__(self, target: TrackerTarget) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing_extra("tensorboard") from None
        log_dir = target.run or os.path.join(target.dir or "runs", f"megascope-{target.name}")
        self.where = f"TensorBoard log dir {log_dir}"
        self.writer = SummaryWriter(log_dir=log_dir)

    def log_steps(self, rows: list[StepScores]) -> None:
        """See :meth:`Tracker.log_steps`."""
        for row in rows:
            for rank, score in sorted(row.scores.items()):
                self.writer.add_scalar(f"megascope/straggler_score/rank_{rank}", score, row.step)
            if row.exposed_comm_ms is not None:
                self.writer.add_scalar("megascope/exposed_comm_ms", row.exposed_comm_ms, row.step)
        self.writer.flush()

    def log_findings(
        self, findings: list[FindingRecord], step: int, new: list[FindingRecord]
    ) -> None:
        """See :meth:`Tracker.log_findings`."""
        for f in new:
            at = f.onset_step if f.onset_step is not None else step
            self.writer.add_scalar(f"megascope/finding/{f.key}/severity", f.severity, at)
        self.writer.add_text("megascope/findings", findings_json(findings), step)
        self.writer.flush()

    def close(self) -> None:
        """See :meth:`Tracker.close`."""
        self.writer.close()
