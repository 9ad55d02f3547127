"""One run as the dashboard sees it: a DuckDB connection, its queries and a cache.

The analyzer's ``open_run`` provides the connection and its views (the SPEC tables,
``steps``, ``rank_coords``, ``collective_rows``); the analyzer's ``analyze`` the findings.

Every view of the dashboard aggregates a per-(rank, step) table, ``dash_rank_step``, built
once per *data version* (analyzer/rank_steps.py, which the trackers' per-step scores read too)
from the analyzer's digests (``rank_step.sql``, exact interval unions, up to ``DRAW_EXACT_MAX_RANKS`` ranks; ``rank_step_digest.sql`` past that): at 12,288 ranks the raw
rows are ~70M while that table is ~0.6M, so a figure query stays well under a second. Beside it,
up to ``DRAW_EXACT_MAX_RANKS`` ranks, ``dash_rank_peer`` compares each rank's compute spans with its
stage peers' in every step (``rank_step_peer.sql``, the rank x step heatmap's default). Links
read the digests too; a timeline reads the folders of the ranks it draws only
(``Run.restricted``), GPU readings a copy of the samples (``dash_gpu``) and the work per rank a
digest of the ``work`` table (``dash_work``, empty without one). The data version is a
fingerprint of the run's files (the modification times of run.json and of every rank folder:
renaming a new part into a folder changes that folder's time), so live mode re-builds the
cache only when a rank wrote something new.

The what-if view replays the run's steps (``analyzer.whatif``): the prepared what-if (graph and
durations, seconds to build on a big run) of the last step range asked and the tables drawn from
it (``analyzer.whatif.views``) are cached per data version too, under a lock of their own so
that the other views do not wait for a replay.

A run that loses a rank folder keeps being served from the rest; :attr:`RunSource.missing` says
which ranks' folders are missing at the last refresh (the run line shows it).

The dashboard's SQL lives beside it in ``dashboard/sql/*.sql`` (the per-(rank, step) tables'
in ``analyzer/sql/rank_steps/``); values are bound as ``$parameters``. The
connection is used by one thread at a time (a lock), since Dash serves callbacks in threads.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, cast

import pandas as pd

from analyzer import duck
from analyzer.db import Run, open_run
from analyzer.duck import DRAW_EXACT_MAX_RANKS
from analyzer.parts import missing_text
from analyzer.rank_steps import build_rank_step_tables
from tracer.rundir import coords_of, read_run_json
from tracer.schema import TABLES

log = logging.getLogger(__name__)

SQL_DIR = Path(__file__).parent / "sql"
WHATIF_TABLES = 8  # step ranges whose what-if tables are kept per data version


@cache
def sql_text(name: str) -> str:
    """The text of ``dashboard/sql/<name>.sql`` (names are ours, never a user's)."""
    return duck.sql_text(name, SQL_DIR)


def fingerprint(run_dir: str) -> tuple[int, int]:
    """(count, newest mtime in ns) over run.json and every ``TABLE/rank=*`` folder."""
    count, newest = 0, 0
    try:
        newest = os.stat(os.path.join(run_dir, "run.json")).st_mtime_ns
    except FileNotFoundError:
        pass
    for table in TABLES:
        try:
            entries = os.scandir(os.path.join(run_dir, table))
        except FileNotFoundError:
            continue
        with entries:
            for entry in entries:
                count += 1
                newest = max(newest, entry.stat().st_mtime_ns)
    return count, newest


class RunSource:
    """A run directory opened for the dashboard; thread-safe, cached per data version."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = str(Path(run_dir).resolve())
        self.meta: dict[str, Any] = read_run_json(self.run_dir)
        self._lock = threading.RLock()
        self._run: Run | None = None
        self._version: tuple[int, int] | None = None
        self._findings: dict[tuple, dict[str, Any]] = {}
        self._topology: pd.DataFrame | None = None
        self._whatif_lock = threading.RLock()
        self._prepared: tuple[Any, Any] | None = None  # (version, steps), WhatIf
        self._whatif: dict[tuple, dict[str, Any]] = {}
        self.builds = 0  # how many times the caches were built (live mode re-builds)
        # which ranks' folders the run lacks at the last refresh (analyzer.parts.missing_text)
        self.missing: str | None = None

    @property
    def mesh(self) -> dict[str, int]:
        """run.json's ``{dp, pp, tp, cp}``, 1 for an axis it leaves out; once the run is
        opened, the one an attached script's process groups tell where run.json has none."""
        mesh = self.meta.get("mesh") or {}
        return {k: int(mesh.get(k, 1)) for k in ("dp", "pp", "tp", "cp")}

    @property
    def live(self) -> bool:
        """Whether run.json says the run is still running."""
        return self.meta.get("status") == "running"

    def refresh(self) -> tuple[int, int]:
        """Re-read run.json and re-build the caches if the run's files changed."""
        with self._lock:
            version = fingerprint(self.run_dir)
            if version == self._version:
                return version
            self.meta = read_run_json(self.run_dir)
            # re-open on every new version: the analyzer's views list the parts found at open
            if self._run is not None:
                self._run.close()
            self._run = run = open_run(self.run_dir)
            # an attached script's layout, read from its process groups (analyzer.meshinfer)
            self.meta = run.meta
            self.missing = missing_text(self.run_dir, run.world_size)
            # dash_rank_step, dash_topology, dash_rank_peer and the view dash_rank_score
            build_rank_step_tables(run, run.world_size <= DRAW_EXACT_MAX_RANKS)
            run.create_table("dash_gpu", sql_text("gpu_samples"))
            run.create_table("dash_work", sql_text("work_digest"))
            self._topology = None
            self._findings.clear()
            self._whatif.clear()
            self._prepared = None
            self._version = version
            self.builds += 1
            log.info("run %s: data version %s", self.run_dir, version)
            return version

    def query(self, name: str, **params: Any) -> pd.DataFrame:
        """Run ``dashboard/sql/<name>.sql`` with bound parameters, after a refresh if needed."""
        with self._lock:
            if self._version is None:
                self.refresh()
            assert self._run is not None
            return self._run.execute(sql_text(name), params or None)

    def query_ranks(self, name: str, ranks: list[int], **params: Any) -> pd.DataFrame:
        """Like :meth:`query` for a query about ``ranks`` only (bound as ``$ranks``): on a
        large run it reads those ranks' folders alone (``Run.restricted``)."""
        with self._lock:
            if self._version is None:
                self.refresh()
            assert self._run is not None
            run = self._run
            if run.world_size > DRAW_EXACT_MAX_RANKS:
                run = run.restricted(ranks)
            return run.execute(sql_text(name), {"ranks": ranks, **params})

    def topology(self) -> pd.DataFrame:
        """rank, host, dp, pp, tp, cp, hw_class for every rank; from run.json's mesh when
        absent."""
        with self._lock:
            if self._topology is None:
                topo = self.query("dash_topology")
                if topo.empty:
                    world = int(self.meta.get("world_size") or 0)
                    rows = [
                        {"rank": r, "host": "?", **coords_of(r, self.mesh), "hw_class": ""}
                        for r in range(world)
                    ]
                    cols = ["rank", "host", "dp", "pp", "tp", "cp", "hw_class"]
                    topo = pd.DataFrame(rows, columns=cols)
                self._topology = topo
            return self._topology

    def findings(self, steps: tuple[int, int] | None) -> dict[str, Any]:
        """The analyzer's report for a step range, cached per data version; over the whole
        run of a running run, that of the newest steps, as ``megascope watch`` has it.

        Returns a report with no findings and a ``note`` when the analyzer is not installed
        or cannot read the run, so the page still draws the data it has.
        """
        key = tuple(steps) if steps else ()
        with self._lock:
            if key in self._findings:
                return self._findings[key]
            if self._version is None:
                self.refresh()
            assert self._run is not None  # opened by refresh() before it sets the version
            if not steps and self.live:  # the steps `megascope watch` analyzes, as it does
                report = _live_report(self._run)
            else:
                report = _run_analyzer(self._run, steps)
            if "note" not in report:  # a failure is tried again on the next request
                self._findings[key] = report
            return report

    def _current_version(self) -> tuple[int, int]:
        with self._lock:
            return self._version if self._version is not None else self.refresh()

    def prepared_whatif(self, steps: tuple[int, int] | None) -> Any:
        """The run prepared for replays (``analyzer.whatif.prepare``) over a step range,
        kept for the last range asked; raises ``analyzer.whatif.WhatIfError`` (one line)."""
        from analyzer.whatif import prepare

        key = (self._current_version(), tuple(steps) if steps else ())
        with self._whatif_lock:
            if self._prepared is not None and self._prepared[0] == key:
                return self._prepared[1]
            w = prepare(self.run_dir, steps or None)
            self._prepared = (key, w)
            return w

    def whatif(self, steps: tuple[int, int] | None) -> dict[str, Any]:
        """The what-if's tables for a step range, cached per data version: ``grid``
        (:func:`analyzer.whatif.views.worker_grid`), ``steps`` (``per_step``) and ``summary``;
        or ``{"error": one line}`` when the run cannot be replayed (no step, a cycle)."""
        from analyzer.whatif import WhatIfError
        from analyzer.whatif import views as wv

        key = (self._current_version(), tuple(steps) if steps else ())
        with self._whatif_lock:  # one replay at a time; the other views do not wait
            if key in self._whatif:
                return self._whatif[key]
            try:
                w = self.prepared_whatif(steps)
                measured, ideal = w.replay(), w.ideal()
                if not len(measured):
                    raise WhatIfError("no step to replay")
                grid = wv.worker_grid(w, ideal=ideal)
                table = wv.per_step(w, measured, ideal)
                out = {"grid": grid, "steps": table, "summary": wv.summary(w, table, grid)}
            except WhatIfError as e:  # the run's own: kept until it changes
                out = {"error": _first_line(e)}
            except Exception as e:  # the page must still draw: tried again on the next request
                log.exception("what-if failed on %s", self.run_dir)
                return {"error": f"the what-if failed: {_first_line(e)}"}
            if len(self._whatif) >= WHATIF_TABLES or any(k[0] != key[0] for k in self._whatif):
                self._whatif.clear()
            self._whatif[key] = out
            return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _run_analyzer(run: Run, steps: tuple[int, int] | None) -> dict[str, Any]:
    try:
        from analyzer.findings import analyze
    except ImportError:
        return {"findings": [], "note": "the analyzer's findings are not installed"}
    try:
        return cast("dict[str, Any]", analyze(run, steps=steps))  # a report, or a note
    except Exception as e:  # the page must still show the data when a rule fails
        log.exception("analyze failed on %s", run.path if run else "?")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"findings": [], "note": f"the analyzer failed: {first}"}


def _live_report(run: Run) -> dict[str, Any]:
    """The report of a running run over the newest steps, those ``megascope watch`` reads."""
    from analyzer.live import WINDOW, live_steps

    try:
        steps = live_steps(run, WINDOW)
    except Exception as e:  # the page must still show the data
        return {"findings": [], "note": f"the analyzer failed: {_first_line(e)}"}
    if steps is None:
        note = f"live: findings once {WINDOW} steps past the warm-up are complete (as watch)"
        return {"findings": [], "note": note}
    return _run_analyzer(run, steps)


def blame_by_rank(report: Mapping[str, Any]) -> dict[int, float]:
    """Fraction of step time the analyzer blames on each rank: the sum of the severities
    of the findings naming it (a finding naming several ranks shares its severity)."""
    blame: dict[int, float] = {}
    for f in report.get("findings", []):
        ranks = [int(r) for r in f.get("ranks", [])]
        for r in ranks:
            blame[r] = blame.get(r, 0.0) + float(f.get("severity", 0.0)) / len(ranks)
    return blame
