"""Reading a run for the what-if: one template step in full, then every step's times.

A training step repeats the same operations on each rank, in the same order. So the
dependency graph is built once, from one step (the *template*), and every step analyzed is
an array over the template's operations: ``t0[op, step]`` (arrival) and ``t1[op, step]`` (end),
in seconds after the step's zero (its first arrival on any rank). A step where some rank ran a
different number of operations than in the template (a warm-up step, a step cut by a hang) is
left out and named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pandas as pd

from analyzer.db import sql_text
from tracer.rundir import read_run_json


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


def _glob(run_dir: str, table: str) -> str | None:
    folder = os.path.join(run_dir, table)
    if not os.path.isdir(folder) or not any(os.scandir(folder)):
        return None
    return os.path.join(folder, "*", "*.parquet").replace("'", "''")


def connect(run_dir: str, threads: int = 2) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with ``spans``, ``collectives`` and the view ``whatif_ops``."""
    con = duckdb.connect(":memory:", config={"threads": threads})
    con.execute("set enable_progress_bar = false")
    empty = {
        "spans": "select 0 as rank, 0 as step, '' as name, '' as kind, 0::bigint as start_ns, "
        "0::bigint as end_ns where false",
        "collectives": "select 0 as rank, 0 as step, '' as op, '' as \"group\", 0::bigint as seq,"
        " 0 as peer, 0::bigint as nbytes, '' as source, 0::bigint as issue_ns, "
        "0::bigint as start_ns, 0::bigint as end_ns where false",
    }
    for table, fallback in empty.items():
        pattern = _glob(run_dir, table)
        text = (
            f"select * from read_parquet('{pattern}', hive_partitioning=false, union_by_name=true)"
            if pattern
            else fallback
        )
        con.execute(f"create view {table} as {text}")
    con.execute(f"create view whatif_ops as {sql_text('whatif/ops')}")
    return con


def _choose_steps(counts: pd.DataFrame) -> tuple[int, list[int], list[int]]:
    """(template step, steps to analyze, steps left out): a step is analyzed when every rank
    that ever ran one ran it with its most common count of operations."""
    ranks = counts["rank"].unique()
    mode = counts.groupby("rank")["n"].agg(lambda s: s.value_counts().idxmax())
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


def read_times(run_dir: str, steps: tuple[int, int] | None = None) -> RunTimes:
    """Read the run at ``run_dir`` (``steps``: an inclusive range to keep)."""
    try:
        meta = read_run_json(run_dir)
    except ValueError as e:
        raise WhatIfError(str(e).splitlines()[0]) from None
    con = connect(run_dir)
    try:
        return _read(con, meta, steps)
    except duckdb.Error as e:
        raise WhatIfError(
            f"{run_dir}: unreadable tables ({str(e).strip().splitlines()[0]})"
        ) from None
    finally:
        con.close()


def _read(con, meta: dict, window: tuple[int, int] | None) -> RunTimes:
    counts = con.execute(sql_text("whatif/counts")).df()
    if window is not None:
        counts = counts[(counts.step >= window[0]) & (counts.step <= window[1])]
    if counts.empty:
        raise WhatIfError("the run has no finished operations in its steps")
    tstep, steps, left_out = _choose_steps(counts)
    zero = counts[counts.step.isin(steps)].groupby("step")["t0"].min()
    rows = con.execute(
        sql_text("whatif/template"), {"step": tstep, "zero": int(zero.loc[tstep])}
    ).df()
    tpl = Template(
        rank=rows["rank"].to_numpy(np.int64),
        cls=rows["cls"].to_numpy(np.int8),
        label=rows["label"].to_numpy(object),
        grp=rows["grp"].to_numpy(object),
        seq=rows["seq"].to_numpy(np.int64),
        peer=rows["peer"].to_numpy(np.int64),
        nbytes=rows["nbytes"].to_numpy(np.int64),
        t0=rows["t0"].to_numpy(np.float64),
        t1=rows["t1"].to_numpy(np.float64),
    )
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
