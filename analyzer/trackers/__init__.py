"""Findings and per-step scores in the user's experiment tracker (``--log-to``).

``megascope analyze RUN --log-to tensorboard|mlflow|wandb`` logs the report's findings (kind,
ranks, severity, onset step) and, per step analyzed, each rank's straggler score (its own time
over its stage peers', the dashboard heatmap's measure: :mod:`analyzer.rank_steps`) and the
step's exposed communication; ``megascope watch RUN --log-to ...`` does so at each look, the
steps it has not logged yet and the findings whenever they change. ``--tracker-run`` names the
user's own run to log into (a TensorBoard log dir, an MLflow run id, a W&B run path), else a
new run is made; ``--tracker-dir`` is where the tracker keeps its files (TensorBoard's root of
log dirs, MLflow's tracking URI or file store, W&B's ``WANDB_DIR``). Each tracker is an
optional extra (``pip install 'megascope[mlflow]'``) and its own module here, behind
:class:`analyzer.trackers.base.Tracker`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from analyzer.trackers.base import FindingRecord, Tracker, TrackerTarget
from tracer.cliutil import UsageError

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "mlflow", "wandb")


def add_tracker_args(p: Any) -> None:
    """``--log-to``, ``--tracker-run``, ``--tracker-dir`` on a command's parser."""
    p.add_argument("--log-to", choices=TRACKERS, metavar="TRACKER",
                   help="also log the findings and per-step scores to tensorboard, mlflow or "
                   "wandb (each an extra: pip install 'megascope[TRACKER]')")  # fmt: skip
    p.add_argument("--tracker-run", metavar="RUN",
                   help="the run to log into: a TensorBoard log dir, an MLflow run id, a W&B "
                   "run path [[ENTITY/]PROJECT/]ID (default: a new run)")  # fmt: skip
    p.add_argument("--tracker-dir", metavar="DIR",
                   help="the tracker's files: TensorBoard's root of log dirs (runs), MLflow's "
                   "tracking URI or store (MLFLOW_TRACKING_URI, else mlruns), WANDB_DIR")  # fmt: skip


def open_tracker(args: Any, run_dir: str) -> TrackerFeed | None:
    """The feed ``args`` ask for (None without ``--log-to``); the run is named after the
    megascope run's id. A missing extra or an unknown run: one line (UsageError)."""
    if args.log_to is None:
        if args.tracker_run is not None or args.tracker_dir is not None:
            raise UsageError("--tracker-run and --tracker-dir go with --log-to")
        return None
    target = TrackerTarget(args.log_to, args.tracker_run, args.tracker_dir, _run_name(run_dir))
    return TrackerFeed(make_tracker(target))


def make_tracker(target: TrackerTarget) -> Tracker:
    """The tracker of ``target.kind``, its run opened."""
    if target.kind == "tensorboard":
        from analyzer.trackers.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker(target)
    if target.kind == "mlflow":
        from analyzer.trackers.mlflow_tracker import MlflowTracker

        return MlflowTracker(target)
    if target.kind == "wandb":
        from analyzer.trackers.wandb_tracker import WandbTracker

        return WandbTracker(target)
    raise UsageError(f"--log-to {target.kind}: expected one of {', '.join(TRACKERS)}")


def _run_name(run_dir: str) -> str:
    from tracer.rundir import read_run_json

    try:
        rid = read_run_json(run_dir).get("run_id")
    except (ValueError, OSError):
        rid = None
    return str(rid or os.path.basename(os.path.abspath(run_dir)) or "run")


class TrackerFeed:
    """What a command sends to its tracker: the steps not logged yet, the findings when they
    change (the severity of each at its onset step, once)."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.logged_to: int | None = None  # the newest step logged
        self.keys: set[str] = set()  # findings whose severity was logged
        self.last: list[dict[str, Any]] | None = None  # the findings last logged
        self.logged = False  # whether anything reached the tracker
        self.failed = False  # whether a look could not be logged (said once)

    def report(
        self, run: Any, findings: Sequence[Mapping[str, Any]], steps: tuple[int, int] | None
    ) -> None:
        """Log from an open run: the per-step scores of ``steps`` past those already logged, and
        ``findings`` (report dicts) where they differ from the last ones logged."""
        try:
            self._report(run, findings, steps)
        except UsageError:
            raise
        except Exception as e:  # the tracker's client failing: one line
            log.debug("tracker failed", exc_info=True)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"--log-to: cannot log to {self.tracker.where}: {first}") from None

    def _report(
        self, run: Any, findings: Sequence[Mapping[str, Any]], steps: tuple[int, int] | None
    ) -> None:
        from analyzer.rank_steps import build_rank_step_tables, step_scores

        if steps is not None:
            lo = steps[0] if self.logged_to is None else max(steps[0], self.logged_to + 1)
            if lo <= steps[1]:
                build_rank_step_tables(run)
                self.tracker.log_steps(step_scores(run, (lo, steps[1])))
                self.logged_to, self.logged = steps[1], True
        recs = [FindingRecord.from_report(f) for f in findings]
        dicts = [r.as_dict() for r in recs]
        if dicts == self.last:
            return
        at = steps[1] if steps is not None else (self.logged_to or 0)
        new = [r for r in recs if r.key not in self.keys]
        self.tracker.log_findings(recs, at, new)
        self.keys |= {r.key for r in new}
        self.last, self.logged = dicts, True

    def look(
        self, run_dir: str, findings: Sequence[Mapping[str, Any]], steps: tuple[int, int] | None
    ) -> None:
        """:meth:`report` for a watch's look: the run opened for it, and left for the next look
        where it cannot be read now (the tracer merging its files, say)."""
        import duckdb

        from analyzer.db import RunError, open_run

        try:
            run = open_run(run_dir)
        except (RunError, ValueError, OSError, duckdb.Error):
            return
        try:
            self.report(run, findings, steps)
        except (RunError, OSError, duckdb.Error):
            log.debug("tracker: the look was not logged", exc_info=True)
        except UsageError as e:  # the tracker failing does not end the watch: said once
            if not self.failed:
                print(f"{e} (the watch goes on)", file=sys.stderr, flush=True)
            self.failed = True
        finally:
            run.close()

    def close(self) -> None:
        """Close the tracker's run and, where something was logged, say on stderr where it is."""
        self.tracker.close()
        if self.logged:
            print(f"logged to {self.tracker.where}", file=sys.stderr, flush=True)
