"""Weights & Biases: through ``wandb`` (the ``wandb`` extra), into the user's run
(``--tracker-run [[ENTITY/]PROJECT/]RUN_ID``, resumed) or a new run of the project ``megascope``
(``WANDB_PROJECT`` where set), under ``--tracker-dir`` (``WANDB_DIR``). Offline unless
``WANDB_MODE`` says otherwise (``wandb sync`` uploads an offline run): megascope never logs in
nor asks for a key."""

from __future__ import annotations

import os
from typing import Any

from analyzer.rank_steps import StepScores
from analyzer.trackers.base import FindingRecord, Tracker, TrackerTarget, missing_extra
from tracer.cliutil import UsageError

PROJECT = "megascope"
STEP = "megascope/step"  # the x axis of megascope's series (a user's run has its own _step)
COLUMNS: list[str | int] = ["kind", "ranks", "severity", "onset_step", "last_step", "message"]


def run_path(path: str) -> dict[str, str]:
    """``[[ENTITY/]PROJECT/]RUN_ID`` (``ENTITY/PROJECT/runs/RUN_ID`` too) as wandb.init's
    ``entity``, ``project`` and ``id``."""
    parts = [p for p in path.strip("/").split("/") if p and p != "runs"]
    if not 1 <= len(parts) <= 3:
        raise UsageError(f"--tracker-run {path}: expected [[ENTITY/]PROJECT/]RUN_ID")
    out = {"id": parts[-1]}
    if len(parts) >= 2:
        out["project"] = parts[-2]
    if len(parts) == 3:
        out["entity"] = parts[0]
    return out


class WandbTracker(Tracker):
    """Series ``megascope/straggler_score/rank_N`` and ``megascope/exposed_comm_ms`` over
    ``megascope/step``, ``megascope/finding/KIND/ranks_N/severity`` at each finding's onset
    step, the findings as the table ``megascope/findings_table`` at each step they change, and the
    run summary's ``megascope/findings`` (a list of the active ones)."""

    def __init__(self, target: TrackerTarget) -> None:
        try:
            import wandb
        except ImportError:
            raise missing_extra("wandb") from None
        self.wandb = wandb
        kwargs: dict[str, Any] = {
            "mode": os.environ.get("WANDB_MODE") or "offline",
            "dir": target.dir,
            "settings": wandb.Settings(silent=True, console="off"),
            "reinit": "create_new",
        }
        if target.run is not None:
            kwargs.update(run_path(target.run), resume="allow")
        else:
            kwargs.update(project=os.environ.get("WANDB_PROJECT") or PROJECT,
                          name=f"megascope-{target.name}", job_type="megascope")  # fmt: skip
        kwargs.setdefault("project", os.environ.get("WANDB_PROJECT") or PROJECT)
        if target.dir is not None:
            os.makedirs(target.dir, exist_ok=True)
        try:
            self.run = wandb.init(**kwargs)
        except Exception as e:  # wandb's errors (a bad run id, no key online): one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"--log-to wandb: {first}") from None
        self.run.define_metric(STEP)
        self.run.define_metric("megascope/*", step_metric=STEP)
        self.where = f"W&B run {self.run.id} ({kwargs['mode']}, {self.run.dir})"

    def log_steps(self, rows: list[StepScores]) -> None:
        """See :meth:`Tracker.log_steps`."""
        for row in rows:
            data: dict[str, float] = {STEP: row.step}
            for rank, score in sorted(row.scores.items()):
                data[f"megascope/straggler_score/rank_{rank}"] = score
            if row.exposed_comm_ms is not None:
                data["megascope/exposed_comm_ms"] = row.exposed_comm_ms
            self.run.log(data)

    def log_findings(
        self, findings: list[FindingRecord], step: int, new: list[FindingRecord]
    ) -> None:
        """See :meth:`Tracker.log_findings`."""
        for f in new:
            at = f.onset_step if f.onset_step is not None else step
            self.run.log({STEP: at, f"megascope/finding/{f.key}/severity": f.severity})
        rows = [[f.kind, ",".join(map(str, f.ranks)), f.severity, f.onset_step, f.last_step,
                 f.message] for f in findings]  # fmt: skip
        table = self.wandb.Table(columns=COLUMNS, data=rows)
        self.run.log({STEP: step, "megascope/findings_table": table})
        self.run.summary["megascope/findings"] = [f.as_dict() for f in findings]

    def close(self) -> None:
        """See :meth:`Tracker.close`."""
        self.run.finish()
        self.wandb.teardown()  # waits for its service to write the run out
