"""Reading a run for the what-if: one template step in full, then every step's times.

A training step repeats the same operations on each rank, in the same order. So the
dependency graph is built once, from one step (the *template*), and every step analyzed is
an array over the template's operations: ``t0[op, step]`` (arrival) and ``t1[op, step]`` (end),
in seconds after the step's zero (its first arrival on any rank). A step where some rank ran a
different number of operations than in the template (a warm-up step, a step cut by a hang) is
left out and named.

A big run is read in batches of ranks (``read_times(batch_ranks=N)``, the default): one DuckDB
query per batch of rank folders sorts the batch's operations by rank, step and order
(whatif/batch.sql), numpy numbers them within each rank's step and keeps their times, in ns, on
the grid of the template's operations; the step choice and each step's zero come from the
batches' counts at the end. The result is the same as that of the whole-run reader
(``batch_ranks=0``: whatif/times.sql's window over every row), whose memory and time grow with
the run's rows past what a 2-core machine has.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from analyzer.db import Run, RunError, open_run
from analyzer.duck import connect, sql_text
from tracer.rundir import folder_ranks


class WhatIfError(ValueError):
    """A run the what-if cannot replay; the message is one line."""


@dataclass
class Template:
    """One step's operations, sorted by (rank, arrival): the columns of whatif/template.sql."""

    rank: np.ndarray  # int64
    cls: np.ndarray  # int8: 0 compute, 1 collective, 2 send, 3 recv
    label: np.ndarray  # object: span name or collective op
    grp: np.ndarray  # object: collective group ('' for spans)
    seq: np.ndarray  # int64
    peer: np.ndarray  # int64
    nbytes: np.ndarray  # int64
    t0: np.ndarray  # float64 seconds after the step's zero
    t1: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)

    @classmethod
    def of(cls, cols: Any, t0: np.ndarray, t1: np.ndarray) -> Template:
        """From columns by name (a DataFrame or a dict of arrays) and the times in seconds."""
        return cls(
            rank=np.asarray(cols["rank"], dtype=np.int64),
            cls=np.asarray(cols["cls"], dtype=np.int8),
            label=np.asarray(cols["label"], dtype=object),
            grp=np.asarray(cols["grp"], dtype=object),
            seq=np.asarray(cols["seq"], dtype=np.int64),
            peer=np.asarray(cols["peer"], dtype=np.int64),
            nbytes=np.asarray(cols["nbytes"], dtype=np.int64),
            t0=np.asarray(t0, dtype=np.float64),
            t1=np.asarray(t1, dtype=np.float64),
        )


@dataclass
class RunTimes:
    """What the what-if reads from a run."""

    meta: dict
    template: Template
    template_step: int
    steps: np.ndarray  # the steps analyzed (int64), in order
    t0: np.ndarray  # (ops, steps) float32
    t1: np.ndarray
    left_out: list[int] = field(default_factory=list)  # steps not analyzed


_EMPTY = {
    "spans": "select 0 as rank, 0 as step, '' as name, '' as kind, 0::bigint as start_ns, "
    "0::bigint as end_ns where false",
    "collectives": "select 0 as rank, 0 as step, '' as op, '' as \"group\", 0::bigint as seq,"
    " 0 as peer, 0::bigint as nbytes, '' as source, 0::bigint as issue_ns, "
    "0::bigint as start_ns, 0::bigint as end_ns where false",
}


def _quote(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


def _set_views(
    con: duckdb.DuckDBPyConnection,
    sources: dict[str, str | None],
    ranks: tuple[int, int] | None = None,
) -> None:
    """(Re)define ``spans`` and ``collectives`` over ``sources`` (a read_parquet argument:
    a quoted glob or a list of files; None: no rows) and ``whatif_ops`` over them; ``ranks``
    (first, last) keeps those ranks' rows only (files of a compacted run hold many ranks)."""
    where = f" where rank between {int(ranks[0])} and {int(ranks[1])}" if ranks else ""
    for table, fallback in _EMPTY.items():
        arg = sources.get(table)
        text = (
            f"select * from read_parquet({arg}, hive_partitioning=false, union_by_name=true)"
            + where
            if arg
            else fallback
        )
        con.execute(f"create or replace view {table} as {text}")
    con.execute(f"create or replace view whatif_ops as {sql_text('whatif/ops')}")


def add_ops_view(run: Run) -> None:
    """The view ``whatif_ops`` (whatif/ops.sql) over an opened run's ``spans`` and
    ``collectives``."""
    run.con.execute(f"create or replace view whatif_ops as {sql_text('whatif/ops')}")


@contextlib.contextmanager
def opened(source: Run | str) -> Iterator[Run]:
    """``source`` itself when opened already, else the run at that path opened for its tables
    alone (analyzer/db.py, which leaves unreadable parts out) and closed after; a run that
    cannot be opened raises :class:`WhatIfError` (one line)."""
    if not isinstance(source, str):
        yield source
        return
    try:
        run = open_run(source, tables_only=True)
    except RunError as e:
        raise WhatIfError(str(e)) from None
    try:
        yield run
    finally:
        run.close()


def _modes(counts: pd.DataFrame) -> pd.Series:
    """Each rank's most common count of operations in a step."""
    return counts.groupby("rank")["n"].agg(lambda s: s.value_counts().idxmax())


def _choose_steps(
    counts: pd.DataFrame, mode: pd.Series | None = None
) -> tuple[int, list[int], list[int]]:
    """(template step, steps to analyze, steps left out): a step is analyzed when every rank
    that ever ran one ran it with its most common count of operations (``mode``)."""
    ranks = counts["rank"].unique()
    if mode is None:
        mode = _modes(counts)
    ok = counts["n"].to_numpy() == mode.reindex(counts["rank"]).to_numpy()
    per_step = (
        pd.DataFrame({"step": counts["step"], "ok": ok}).groupby("step")["ok"].agg(["all", "size"])
    )
    good = per_step[(per_step["all"]) & (per_step["size"] == len(ranks))].index
    steps = sorted(int(s) for s in good)
    left_out = sorted(int(s) for s in per_step.index if int(s) not in set(steps))
    if not steps:
        raise WhatIfError("no step has the same operations on every rank as the others")
    return steps[len(steps) // 2], steps, left_out


BATCH_RANKS = 1024  # rank folders per query of the batched reader


def read_times(
    source: Run | str, steps: tuple[int, int] | None = None, batch_ranks: int = BATCH_RANKS
) -> RunTimes:
    """Read a run (opened, or its path) (``steps``: an inclusive range to keep),
    ``batch_ranks`` rank folders at a time (0: the whole run in one query). The parts are the
    run's readable ones: a part found unreadable on the way is left out of the run, as its
    other readers leave it out, and the reading starts again."""
    with opened(source) as run:

        def read() -> RunTimes:
            if batch_ranks > 0:
                times = _read_batched(run, steps, batch_ranks)
                if times is not None:
                    return times
            add_ops_view(run)
            return _read(run.con, run.meta, steps)

        try:
            return run.retrying(read)
        except (duckdb.Error, RunError) as e:
            raise WhatIfError(
                f"{run.path}: unreadable tables ({str(e).strip().splitlines()[0]})"
            ) from None


def _query_template(con, tstep: int, zero: int) -> Template:
    rows = con.execute(sql_text("whatif/template"), {"step": tstep, "zero": zero}).df()
    return Template.of(rows, rows["t0"], rows["t1"])


def _read(con, meta: dict, window: tuple[int, int] | None) -> RunTimes:
    counts = con.execute(sql_text("whatif/counts")).df()
    if window is not None:
        counts = counts[(counts.step >= window[0]) & (counts.step <= window[1])]
    if counts.empty:
        raise WhatIfError("the run has no finished operations in its steps")
    tstep, steps, left_out = _choose_steps(counts)
    zero = counts[counts.step.isin(steps)].groupby("step")["t0"].min()
    tpl = _query_template(con, tstep, int(zero.loc[tstep]))
    step_tab = pd.DataFrame(
        {"step": steps, "idx": np.arange(len(steps)), "zero_ns": zero.loc[steps].to_numpy()}
    )
    con.register("whatif_steps", step_tab)
    base = np.searchsorted(tpl.rank, np.arange(tpl.rank.max() + 2 if len(tpl) else 1))
    n_ops, n_steps = len(tpl), len(steps)
    t0 = np.zeros((n_ops, n_steps), dtype=np.float32)
    t1 = np.zeros((n_ops, n_steps), dtype=np.float32)
    reader = con.sql(sql_text("whatif/times")).to_arrow_reader(1 << 21)
    for batch in reader:
        cols = {name: batch.column(i).to_numpy() for i, name in enumerate(batch.schema.names)}
        _scatter(cols, base, t0, t1)
    return RunTimes(meta, tpl, tstep, np.array(steps, dtype=np.int64), t0, t1, left_out)


def _scatter(chunk: dict, base: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> None:
    rank = np.asarray(chunk["rank"], dtype=np.int64)
    slot = base[rank] + np.asarray(chunk["pos"], dtype=np.int64)
    idx = np.asarray(chunk["idx"], dtype=np.int64)
    t0[slot, idx] = chunk["t0"]
    t1[slot, idx] = chunk["t1"]


# -- the batched reader ---------------------------------------------------------------------

NO_TIME = np.iinfo(np.int64).max  # a null arrival: sorts last, as DuckDB's nulls do


@dataclass
class _Batch:
    """One batch of ranks: its operations' times (ns) at (position in the batch's part of the
    template, step), for the (rank, step)s that ran the rank's usual count of operations."""

    n_ops: int
    steps: np.ndarray  # the grid's columns
    t0: np.ndarray  # (n_ops, steps) int64
    t1: np.ndarray
    nulls: bool  # some arrival is NO_TIME


def _rank_folders(run: Run) -> list[tuple[int, dict[str, list[str]]]] | None:
    """(rank, table -> the readable Parquet files holding its rows) per rank, by rank; None
    when a folder's name is neither ``rank=N`` nor ``ranks=L-H`` (the whole-run reader then
    reads the run). Every rank of a compacted run's ``ranks=L-H`` folder maps to that folder's
    files, which hold the other ranks of the range too: the batch reader filters by rank."""
    found: dict[int, dict[str, list[str]]] = {}
    for table in _EMPTY:
        by_folder: dict[str, list[str]] = {}
        for path in run.table_files(table):
            by_folder.setdefault(os.path.dirname(path), []).append(path)
        for folder, files in by_folder.items():
            span = folder_ranks(os.path.basename(folder))
            if span is None:
                return None
            for rank in range(span[0], span[1] + 1):
                found.setdefault(rank, {}).setdefault(table, []).extend(sorted(files))
    return sorted(found.items())


def _read_batched(run: Run, window: tuple[int, int] | None, batch_ranks: int) -> RunTimes | None:
    """The batched reader (module docstring); None when the run's layout does not allow it."""
    meta = run.meta
    folders = _rank_folders(run)
    if folders is None:
        return None
    lo, hi = window if window is not None else (0, np.iinfo(np.int32).max)
    parts = [folders[i : i + batch_ranks] for i in range(0, len(folders), batch_ranks)]
    con = connect()

    def query(part, tstep: int):
        files = {t: list(dict.fromkeys(f for _, fs in part for f in fs.get(t, []))) for t in _EMPTY}
        ranged = any(
            os.path.basename(os.path.dirname(f)).startswith("ranks=")
            for fs in files.values()
            for f in fs
        )
        _set_views(con, {
            t: "[" + ", ".join(_quote(f) for f in fs) + "]" if fs else None
            for t, fs in files.items()
        }, (part[0][0], part[-1][0]) if ranged else None)  # fmt: skip
        params = {"tstep": tstep, "lo": int(lo), "hi": int(hi)}
        return con.sql(sql_text("whatif/batch"), params=params).to_arrow_table()

    counts, modes, batches, tpl_parts = [], [], [], []
    guess, last_rank = -1, -1
    try:
        # DuckDB reads the next batch while numpy places this one (both release the GIL)
        with ThreadPoolExecutor(1) as pool:
            ahead = None
            for k, part in enumerate(parts):
                tab = ahead.result() if ahead is not None else query(part, guess)
                ahead = None
                if guess >= 0 and k + 1 < len(parts):
                    ahead = pool.submit(query, parts[k + 1], guess)
                if not tab.num_rows:
                    continue
                cnt, mode, batch = _batch(tab)
                if int(cnt["rank"].iloc[0]) <= last_rank:  # a rank in two batches
                    return None
                last_rank = int(cnt["rank"].iloc[-1])
                if guess < 0:  # the template step as far as this batch tells
                    guess = _choose_steps(cnt, mode)[0] if _has_step(cnt, mode) else -1
                tpl_parts.append(_template_rows(tab, guess))
                counts.append(cnt)
                modes.append(mode)
                batches.append(batch)
                del tab
    finally:
        con.close()
    if not counts:
        raise WhatIfError("the run has no finished operations in its steps")
    counts_all = pd.concat(counts, ignore_index=True)
    tstep, steps, left_out = _choose_steps(counts_all, pd.concat(modes))
    zero = counts_all[counts_all.step.isin(steps)].groupby("step")["t0"].min()
    n_ops = sum(b.n_ops for b in batches)
    if tstep == guess:
        tpl = _template(tpl_parts, tstep, int(zero.loc[tstep]))
    else:  # the first batch guessed another step: read the template step alone
        add_ops_view(run)
        tpl = _query_template(run.con, tstep, int(zero.loc[tstep]))
    if len(tpl) != n_ops:
        return None
    step_arr = np.array(steps, dtype=np.int64)
    zero_ns = zero.loc[steps].to_numpy(np.int64)
    t0 = np.zeros((n_ops, len(steps)), dtype=np.float32)
    t1 = np.zeros((n_ops, len(steps)), dtype=np.float32)
    at = 0
    while batches:
        b = batches.pop(0)
        cols = np.searchsorted(b.steps, step_arr)
        for grid, out in ((b.t0, t0), (b.t1, t1)):
            block = grid[:, cols]
            sec = (block - zero_ns) / 1e9
            if b.nulls:
                sec[block == NO_TIME] = np.nan
            out[at : at + b.n_ops] = sec
        at += b.n_ops
    return RunTimes(meta, tpl, tstep, step_arr, t0, t1, left_out)


def _has_step(counts: pd.DataFrame, mode: pd.Series) -> bool:
    try:
        _choose_steps(counts, mode)
    except WhatIfError:
        return False
    return True


def _batch(tab) -> tuple[pd.DataFrame, pd.Series, _Batch]:
    """A batch's counts (as whatif/counts.sql), its ranks' modes and its times on the grid."""
    rank = tab.column("rank").to_numpy().astype(np.int64)
    step = tab.column("step").to_numpy().astype(np.int64)
    t0c = tab.column("t0")
    nulls = t0c.null_count > 0
    t0 = t0c.fill_null(NO_TIME).to_numpy() if nulls else t0c.to_numpy()
    t1 = tab.column("t1").to_numpy()
    t0 = t0.astype(np.int64, copy=False)
    t1 = t1.astype(np.int64, copy=False)
    n = len(rank)
    starts = np.flatnonzero(np.r_[True, (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])])
    sizes = np.diff(np.r_[starts, n])
    cnt = pd.DataFrame({
        "rank": rank[starts], "step": step[starts], "n": sizes, "t0": t0[starts],
        "t1": np.maximum.reduceat(t1, starts),
    })  # fmt: skip
    if nulls:
        t1 = np.where(t0 == NO_TIME, t1, np.maximum(t1, t0))
    else:
        t1 = np.maximum(t1, t0)
    mode = _modes(cnt)
    ranks = mode.index.to_numpy(np.int64)
    per_rank = mode.to_numpy(np.int64)
    base = np.cumsum(per_rank) - per_rank
    g_rank = np.searchsorted(ranks, rank[starts])
    ok = sizes == per_rank[g_rank]
    grid_steps = np.unique(step)
    g_col = np.searchsorted(grid_steps, step[starts])
    # the rows of the (rank, step)s at their rank's count: their slot and column
    rows = np.repeat(ok, sizes)
    first = np.repeat(starts, sizes)[rows]
    idx = np.flatnonzero(rows)
    slot = np.repeat(base[g_rank], sizes)[rows] + (idx - first)
    col = np.repeat(g_col, sizes)[rows]
    n_ops = int(per_rank.sum())
    g0 = np.empty((n_ops, len(grid_steps)), dtype=np.int64)
    g1 = np.empty((n_ops, len(grid_steps)), dtype=np.int64)
    g0[slot, col] = t0[idx]
    g1[slot, col] = t1[idx]
    return cnt, mode, _Batch(n_ops, grid_steps, g0, g1, nulls)


def _template_rows(tab, tstep: int) -> dict[str, np.ndarray]:
    """The rows of step ``tstep`` (none when -1) of a batch, the template's columns."""
    step = tab.column("step").to_numpy()
    keep = np.flatnonzero(step == tstep)
    sub = tab.take(keep)
    out = {}
    for name in ("rank", "cls", "t0", "t1"):
        col = sub.column(name)
        if name == "t0":
            col = col.fill_null(NO_TIME)
        out[name] = col.to_numpy()
    for name in ("label", "grp", "seq", "peer", "nbytes"):
        out[name] = sub.column(f"tpl_{name}").to_numpy(zero_copy_only=False)
    return out


def _template(parts: list[dict], tstep: int, zero: int) -> Template:
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    t0 = cols["t0"].astype(np.int64)
    t1 = cols["t1"].astype(np.int64)
    null = t0 == NO_TIME
    t1 = np.where(null, t1, np.maximum(t1, t0))
    t0s = (t0 - zero) / 1e9
    t0s[null] = np.nan
    return Template.of(cols, t0s, (t1 - zero) / 1e9)
