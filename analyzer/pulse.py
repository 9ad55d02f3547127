"""A watch's quick look between its full ones: the newest steps' digests alone.

A full look (``megascope watch``, analyzer/live.py) opens the run and runs every
detector over its newest window of steps: under a second up to a few hundred ranks, about ten
at 12,288. A pulse reads only the stored digests (docs/spec.md §2 ``digests``) of the steps it
has not read yet, keeps the window's per-(rank, step) rows in memory and gives what a look
shows between diagnoses: the window (the same steps as a full look's), the median step time,
each rank's compute, and a screen, the ranks whose own work is above their peers' in most of
the window (what the straggler detector tests first, without its noise test), which makes the
watch look in full.

What a pulse reads: the steps from the oldest one some rank may still add to (every rank has
digests past the steps before it) to the newest, in the files under ``RUN/digests`` that hold
them and are new or rewritten since the last pulse. A run written whole has a few files holding
every step, read again filtered to those steps; the tracer's per-flush files are read while
they hold such steps. While the run trains, a pulse reads once every rank that had not closed a
step past the newest complete one wrote a new file (:meth:`Pulse._moves`): the window's end
moves only then, and on shared cores a read of the ranks that flushed first could hold up the
read of the last one's step. A run without stored digests (an older run, an import) has no pulse:
:meth:`Pulse.look` returns None and the watch looks in full each time.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from analyzer.db import sql_text
from analyzer.digests import KINDS, combine
from analyzer.duck import EXACT_MAX_RANKS, connect
from analyzer.findings import live_last_step
from analyzer.findings.common import Thresholds
from analyzer.findings.onset import Turn, turned
from analyzer.table_view import create_table_view
from tracer.rundir import AXES, MeshError, folder_ranks, mesh_sizes, read_run_json

COLUMNS = ["rank", "step", "cls", "step_ns", "compute_ns", "work_ns", "runq_ns"]


@dataclass
class Beat:
    """One pulse: the run's status and world, the window it covers (None until there are enough
    steps past the warm-up), the median step time, each rank's median compute (seconds) and the
    ranks the screen names."""

    status: str
    world: int = 0
    steps: tuple[int, int] | None = None
    step_s: float | None = None
    compute_s: dict[int, float] = field(default_factory=dict)
    suspects: frozenset[int] = frozenset()
    read_steps: int = 0  # steps whose digests this pulse read
    turns: list[Turn] = field(default_factory=list)  # ranks that turned slow in the window


@dataclass(frozen=True)
class _Last:
    """The beat a pulse made last, and the window it was made for."""

    window: int
    beat: Beat


class Pulse:
    """Follows one run's digests, step by step (see the module docstring)."""

    def __init__(self, run_dir: str, thresholds: Thresholds | None = None) -> None:
        self.run_dir = run_dir
        self.thresholds = thresholds or Thresholds()
        self.con = connect()
        self.file_last: dict[tuple[str, int, int], int] = {}  # (file, time, size) -> newest step
        self.rank_last: dict[int, int] = {}  # rank -> its newest step with spans
        self.rank_closed: dict[int, int] = {}  # rank -> its newest step with a `step` span
        self.status = "running"
        self.frontier: int | None = None  # the newest step a look would read (window's end)
        self.first: int | None = None  # the run's first step
        self.settled = 0  # steps before it are read for good
        self.world = 0
        self.mesh: dict[str, int] = {}  # run.json's mesh, as of the last read
        self.rows = pd.DataFrame(columns=COLUMNS)
        self.turns: list[Turn] = []  # the window's turns, as of the last read (:meth:`_beat`)
        self._last: _Last | None = None  # the last beat made, given again while nothing is new

    def close(self) -> None:
        """Close the pulse's DuckDB connection."""
        self.con.close()

    def _files(self) -> tuple[list[str], set[int] | None]:
        """The digests files that may hold steps from ``settled`` on, and the ranks whose
        files are new or rewritten in place (another size or time) since the last pulse: None
        where such a file is not one rank's (a run's merged files)."""
        found = glob.glob(os.path.join(self.run_dir, "digests", "**", "*.parquet"), recursive=True)
        out: list[str] = []
        fresh: set[int] | None = set()
        for path in sorted(found):
            try:
                st = os.stat(path)
            except OSError:
                continue  # merged away since listed
            key = (path, st.st_mtime_ns, st.st_size)
            last = self.file_last.get(key)
            if last is None and fresh is not None:
                ranks = folder_ranks(os.path.basename(os.path.dirname(path)))
                if ranks is None or ranks[0] != ranks[1]:
                    fresh = None
                else:
                    fresh.add(ranks[0])
            if last is None or last >= self.settled:
                out.append(path)
        return out, fresh

    def _moves(self, fresh: set[int] | None) -> bool:
        """Whether new files of the ranks ``fresh`` may move what a look shows: the window
        ends at the newest step every rank wrote, so while the run trains, new steps come only
        once every rank that had not closed a step past it wrote again (a read before that,
        on shared cores a tenth of a second or more, would delay the one that matters)."""
        if fresh is None:
            return True
        if not fresh:
            return False
        if self.frontier is None or self.world <= 0 or len(self.rank_last) < self.world:
            return True
        behind = {r for r in self.rank_last if self.rank_closed.get(r, -1) <= self.frontier}
        return behind <= fresh

    def look(self, window: int) -> Beat | None:
        """Read the digests of the steps not settled yet (the newest ``window`` at most); None
        where the run has no stored digests, or its files changed while read."""
        try:
            meta = read_run_json(self.run_dir)
        except ValueError:
            return None
        status = str(meta.get("status", "running"))
        files, fresh = self._files()
        if not files and not self.file_last:
            return None
        # an ended run's newest step is complete
        changed = status != self.status or (status != "running" and fresh != set())
        changed = changed or self._moves(fresh)
        self.status = status
        if not changed and self._last is not None and self._last.window == window:
            return replace(self._last.beat, read_steps=0)  # nothing new: a listing's cost
        kept = self._state()
        try:
            read = self._read(files, meta, window) if changed else 0
        except (duckdb.Error, OSError):
            # parts merged or replaced while read: as if not read, the next pulse reads the new
            # ones (a file marked read here, its rows not taken, would be skipped for good)
            (self.file_last, self.rank_last, self.rank_closed, self.frontier, self.first,
             self.settled) = kept  # fmt: skip
            return None
        beat = self._beat(status, window, read)
        self._last = _Last(window, beat)
        return beat

    def _state(self) -> tuple[Any, ...]:
        """What :meth:`_read` changes before its last query: kept, to put back on a failure."""
        return (dict(self.file_last), dict(self.rank_last), dict(self.rank_closed),
                self.frontier, self.first, self.settled)  # fmt: skip

    def _read(self, files: list[str], meta: dict, window: int) -> int:
        """Read the steps of ``files`` from ``settled`` on; return how many were read."""
        # the digests' SPEC columns, as a run's own view reads them, and the part of each row
        create_table_view(self.con, "digests", files, True, view="pulse_rows", filename=True)
        reach = self.con.execute(sql_text("pulse/frontier"), {"from": self.settled}).df()
        for f in files:  # none newer than settled, unless listed
            st = os.stat(f)
            self.file_last[(f, st.st_mtime_ns, st.st_size)] = self.settled - 1
        ranks = reach[reach.what == "rank"]
        self.rank_last.update(
            zip(ranks["rank"].astype(int), ranks.last_step.astype(int), strict=True)
        )
        closed = ranks[ranks.closed_step.notna()]
        for rank, step in zip(closed["rank"].astype(int), closed.closed_step.astype(int),
                              strict=True):  # fmt: skip
            self.rank_closed[rank] = max(step, self.rank_closed.get(rank, step))
        for f, last in zip(
            reach.file[reach.what == "file"], reach.last_step[reach.what == "file"], strict=True
        ):
            st = os.stat(f)
            self.file_last[(f, st.st_mtime_ns, st.st_size)] = int(last)
        if reach.empty:
            return 0
        if self.first is None:
            self.first = int(reach.first_step.min())
        world = self.world = int(meta.get("world_size") or 0) or len(self.rank_last)
        self.mesh = dict(meta.get("mesh") or {})
        if not self.rank_last:
            return 0
        # the full look's newest step (live.live_steps): the newest any rank reached, or while
        # the run trains, the newest every rank wrote all of
        hi = max(self.rank_last.values())
        every = self.rank_closed.keys() >= self.rank_last.keys()
        finished = min(self.rank_closed.values()) if every else None
        hi = live_last_step(meta, hi, min(self.rank_last.values()), finished)
        self.frontier = hi if self.frontier is None else max(self.frontier, hi)
        lo = max(self.settled, hi - window + 1, self.first)
        if hi < lo:
            return 0
        self.con.execute(
            f"create or replace view digest_source as select * exclude (filename) "
            f"from pulse_rows where step between {int(lo)} and {int(hi)}"
        )
        combine(self.con)
        self.con.execute(
            f"create or replace view rank_step_sums as {sql_text('views/rank_step_sums')}"
        )
        try:
            size = mesh_sizes(meta.get("mesh") or {})
        except MeshError:
            size = dict.fromkeys(AXES, 1)
        fits = int(np.prod(list(size.values()))) == world
        classes = {
            "stage_ranks": world // size["pp"] if fits else 0,
            "tp": size["tp"],
            "cp": size["cp"],
        }
        new = self.con.execute(sql_text("pulse/rank_steps"), {"lo": lo, "hi": hi, **classes}).df()
        for kind in KINDS:
            self.con.execute(f"drop table if exists digest_{kind}")
        keep = self.rows[(self.rows.step > hi - window) & (self.rows.step < lo)]
        self.rows = pd.concat([keep, new], ignore_index=True) if not keep.empty else new
        # steps before the one the slowest rank is in are settled; all of them when every rank
        # has reported (a step may reach the files in two flushes)
        reported = len(self.rank_last) >= world
        self.settled = max(self.settled, min(self.rank_last.values()) if reported else lo)
        return hi - lo + 1

    def _beat(self, status: str, window: int, read: int) -> Beat:
        rows = self.rows
        if rows.empty or self.first is None:
            return Beat(status, self.world, read_steps=read)
        hi = int(rows.step.max())
        warmup = 2 if hi - self.first + 1 >= 10 else 1 if hi - self.first + 1 >= 4 else 0
        if hi - (self.first + warmup) + 1 < window:
            return Beat(status, self.world, read_steps=read)
        rows = rows[rows.step > hi - window]
        step_s = float(rows.groupby("step").step_ns.median().median()) / 1e9
        compute = rows.groupby("rank").compute_ns.median() / 1e9
        if read and self.world <= EXACT_MAX_RANKS:
            self.turns = self._turns(rows)
        return Beat(
            status,
            self.world,
            (hi - window + 1, hi),
            step_s,
            {int(r): float(s) for r, s in compute.items()},
            self._screen(rows),
            read,
            self.turns,
        )

    def _turns(self, rows: pd.DataFrame) -> list[Turn]:
        """The ranks that turned slow in the window (:func:`analyzer.findings.onset.turned`)."""
        return turned(_own(rows).assign(pp=rows.cls), self.thresholds)

    def _screen(self, rows: pd.DataFrame) -> frozenset[int]:
        """Ranks whose own work (:func:`_own`) is above their class's median by
        ``min_excess`` over the window and by half of it in ``persistence`` of its steps."""
        th = self.thresholds
        rows = _own(rows)
        rows = rows[rows.work_ns > 0]
        ref = rows.groupby(["step", "cls"]).work_ns.transform("median")
        ratio = rows.work_ns / ref.where(ref > 0)
        per = pd.DataFrame({"rank": rows["rank"], "ratio": ratio}).dropna()
        agg = (
            per.assign(late=per.ratio >= 1 + th.min_excess / 2)
            .groupby("rank")
            .agg(ratio=("ratio", "median"), late=("late", "mean"))
        )
        named = agg[(agg.ratio >= 1 + th.min_excess) & (agg.late >= th.persistence)]
        return frozenset(int(r) for r in named.index)


def _own(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with ``work_ns`` less the step's wait for a core (``runq_ns``) where the tracer
    recorded it: where ranks share a host's cores, the time the scheduler gave to others is
    no rank's own work (analyzer.findings.onset.excess_of reads it so too)."""
    runq = pd.to_numeric(rows.runq_ns, errors="coerce").fillna(0.0)
    return rows.assign(work_ns=(rows.work_ns.astype(float) - runq).clip(lower=0.0))
