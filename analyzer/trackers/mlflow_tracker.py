"""MLflow: through ``mlflow.tracking.MlflowClient`` (the ``mlflow`` extra: mlflow-skinny), into
the user's run (``--tracker-run RUN_ID``) or a new run of the experiment ``megascope``
(``MLFLOW_EXPERIMENT_NAME`` where set). The store: ``--tracker-dir`` (a tracking URI, or a
directory for a local file store), else ``MLFLOW_TRACKING_URI``, else ``./mlruns``. MLflow 3
keeps its file store in maintenance mode, behind ``MLFLOW_ALLOW_FILE_STORE``: a store given as a
directory sets it (a database or a server is a tracking URI: ``sqlite:///mlflow.db``,
``http://host:5000``)."""

from __future__ import annotations

import os
import time

from analyzer.rank_steps import StepScores
from analyzer.trackers.base import (
    FindingRecord,
    Tracker,
    TrackerTarget,
    findings_json,
    missing_extra,
)
from tracer.cliutil import UsageError

BATCH = 1000  # metrics per log_batch call (MLflow's limit)
EXPERIMENT = "megascope"


def tracking_uri(target_dir: str | None) -> str:
    """``--tracker-dir`` as a tracking URI: kept where it has a scheme, else a ``file:`` URI of
    the directory; without it ``MLFLOW_TRACKING_URI``, else ``./mlruns``."""
    where = target_dir or os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
    if "://" in where or where.startswith("file:"):
        return where
    return "file:" + os.path.abspath(where)


class MlflowTracker(Tracker):
    """Metrics ``straggler_score/rank_N`` and ``exposed_comm_ms`` per step,
    ``finding/KIND/ranks_N/severity`` at each finding's onset step, the findings as the text
    artifact ``megascope/findings.json`` and the tag ``megascope.findings`` (how many)."""

    def __init__(self, target: TrackerTarget) -> None:
        try:
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise missing_extra("mlflow") from None
        uri = tracking_uri(target.dir)
        if uri.startswith("file:"):  # MLflow 3 opens a file store only when asked to
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.own = target.run is None
        try:
            self.client = MlflowClient(tracking_uri=uri)
            if target.run is not None:
                self.run_id = self.client.get_run(target.run).info.run_id
            else:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
                exp = self.client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
                run = self.client.create_run(exp_id, run_name=f"megascope-{target.name}",
                                             tags={"megascope.run_id": target.name})  # fmt: skip
                self.run_id = run.info.run_id
        except MlflowException as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"--log-to mlflow ({uri}): {first}") from None
        self.where = f"MLflow run {self.run_id} ({uri})"

    def _metrics(self, rows: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value, step in rows]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + BATCH])

    def log_steps(self, rows: list[StepScores]) -> None:
        """See :meth:`Tracker.log_steps`."""
        out = []
        for row in rows:
            out += [
                (f"straggler_score/rank_{r}", s, row.step) for r, s in sorted(row.scores.items())
            ]
            if row.exposed_comm_ms is not None:
                out.append(("exposed_comm_ms", row.exposed_comm_ms, row.step))
        self._metrics(out)

    def log_findings(
        self, findings: list[FindingRecord], step: int, new: list[FindingRecord]
    ) -> None:
        """See :meth:`Tracker.log_findings`."""
        self._metrics([(f"finding/{f.key}/severity", f.severity,
                        f.onset_step if f.onset_step is not None else step) for f in new])  # fmt: skip
        self.client.log_text(self.run_id, findings_json(findings), "megascope/findings.json")
        self.client.set_tag(self.run_id, "megascope.findings", str(len(findings)))

    def close(self) -> None:
        """See :meth:`Tracker.close`."""
        if self.own:
            self.client.set_terminated(self.run_id)
