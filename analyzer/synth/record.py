"""Collecting the simulated events and turning them into per-rank Arrow tables.

Every event the step model produces happens on all ranks of one pipeline stage at once: one
forward span of microbatch 3 on stage 1, one tp all_gather with seq 17 on stage 1. So an event
is stored once, with its static columns (step, microbatch, name or op, group, seq, bytes, ...)
as scalars and its times as one array over the stage's ranks. Writing a rank's table then takes
the static columns as they are (shared by every rank of the stage) and one column of the stacked
time arrays.

Times are float64 seconds since the run's start; ``inf`` means "never happened" (a rank that
is hung or waits on one). A row is kept when its start is finite; an end that is infinite
becomes a null ``end_ns`` (the rank was still waiting when the run was stopped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from tracer.schema import TABLES


@dataclass
class StageLog:
    """The events of one pipeline stage during one chunk of steps."""

    span_static: list[tuple[int, int, str, str, str]] = field(default_factory=list)
    span_start: list[np.ndarray] = field(default_factory=list)
    span_end: list[np.ndarray] = field(default_factory=list)
    coll_static: list[tuple[int, int, str, str, int, int, int, int]] = field(default_factory=list)
    coll_issue: list[np.ndarray] = field(default_factory=list)
    coll_start: list[np.ndarray] = field(default_factory=list)
    coll_end: list[np.ndarray] = field(default_factory=list)

    def span(self, step: int, mb: int, name: str, kind: str, source: str, start, end) -> None:
        self.span_static.append((step, mb, name, kind, source))
        self.span_start.append(np.array(start, dtype=np.float64).reshape(-1))
        self.span_end.append(np.array(end, dtype=np.float64).reshape(-1))

    def collective(
        self,
        step: int,
        mb: int,
        op: str,
        group: str,
        group_size: int,
        seq: int,
        peer_offset: int,
        nbytes: int,
        issue,
        start,
        end,
    ) -> None:
        """One collective (or one side of a send/recv; ``peer_offset`` != 0 gives the peer)."""
        self.coll_static.append((step, mb, op, group, group_size, seq, peer_offset, int(nbytes)))
        self.coll_issue.append(np.array(issue, dtype=np.float64).reshape(-1))
        self.coll_start.append(np.array(start, dtype=np.float64).reshape(-1))
        self.coll_end.append(np.array(end, dtype=np.float64).reshape(-1))


def _ns(t: np.ndarray, base_ns: int) -> np.ndarray:
    """Seconds since the start as int64 epoch nanoseconds (callers mask the infinite ones)."""
    safe = np.where(np.isfinite(t), t, 0.0)
    return base_ns + np.rint(safe * 1e9).astype(np.int64)


@dataclass
class StageTables:
    """A stage's events stacked: static columns as Arrow arrays, times as (ranks, events)."""

    span_cols: dict[str, pa.Array]
    span_times: tuple[np.ndarray, np.ndarray]
    coll_cols: dict[str, pa.Array]
    coll_peer_offset: np.ndarray
    coll_times: tuple[np.ndarray, np.ndarray, np.ndarray]


def stack_stage(log: StageLog) -> StageTables:
    """Stack a stage's events once; per-rank tables then only slice."""
    s = list(zip(*log.span_static, strict=True)) if log.span_static else [[]] * 5
    span_cols = {
        "step": pa.array(np.array(s[0], dtype=np.int32)),
        "microbatch": pa.array(np.array(s[1], dtype=np.int32)),
        "name": pa.array(list(s[2]), type=pa.string()),
        "kind": pa.array(list(s[3]), type=pa.string()),
        "source": pa.array(list(s[4]), type=pa.string()),
    }
    c = list(zip(*log.coll_static, strict=True)) if log.coll_static else [[]] * 8
    coll_cols = {
        "step": pa.array(np.array(c[0], dtype=np.int32)),
        "microbatch": pa.array(np.array(c[1], dtype=np.int32)),
        "op": pa.array(list(c[2]), type=pa.string()),
        "group": pa.array(list(c[3]), type=pa.string()),
        "group_size": pa.array(np.array(c[4], dtype=np.int32)),
        "seq": pa.array(np.array(c[5], dtype=np.int64)),
        "nbytes": pa.array(np.array(c[7], dtype=np.int64)),
        "dtype": pa.array(["bfloat16"] * len(c[0]), type=pa.string()),
        "source": pa.array(["cuda"] * len(c[0]), type=pa.string()),
    }

    def stack(arrays: list[np.ndarray]) -> np.ndarray:
        return np.ascontiguousarray(np.stack(arrays, axis=1)) if arrays else np.zeros((0, 0))

    return StageTables(
        span_cols=span_cols,
        span_times=(stack(log.span_start), stack(log.span_end)),
        coll_cols=coll_cols,
        coll_peer_offset=np.array(c[6], dtype=np.int64),
        coll_times=(stack(log.coll_issue), stack(log.coll_start), stack(log.coll_end)),
    )


def _time_array(t: np.ndarray, base_ns: int) -> pa.Array:
    finite = np.isfinite(t)
    return pa.array(_ns(t, base_ns), mask=None if finite.all() else ~finite)


def _subset(cols: dict[str, pa.Array], keep: np.ndarray | None) -> dict[str, pa.Array]:
    if keep is None:
        return cols
    idx = pa.array(np.flatnonzero(keep))
    return {k: v.take(idx) for k, v in cols.items()}


def rank_spans(
    st: StageTables, j: int, rank: int, base_ns: int, keep: np.ndarray | None
) -> pa.Table:
    """Spans of the ``j``-th rank of a stage (global ``rank``); ``keep`` filters rows."""
    start, end = st.span_times[0][j], st.span_times[1][j]
    ok = np.isfinite(start) if keep is None else (np.isfinite(start) & keep)
    keep_rows = None if ok.all() else ok
    cols = _subset(st.span_cols, keep_rows)
    if keep_rows is not None:
        start, end = start[keep_rows], end[keep_rows]
    n = len(start)
    arrays = {
        **cols,
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        "start_ns": _time_array(start, base_ns),
        "end_ns": _time_array(end, base_ns),
    }
    schema = TABLES["spans"]
    return pa.Table.from_arrays([arrays[f.name] for f in schema], schema=schema)


def rank_collectives(
    st: StageTables, j: int, rank: int, base_ns: int, keep: np.ndarray | None
) -> pa.Table:
    """Collectives of the ``j``-th rank of a stage. A row whose transfer never began (it
    waits on a peer that never came) keeps its issue time as start and a null end."""
    issue, start, end = (t[j] for t in st.coll_times)
    ok = np.isfinite(issue) if keep is None else (np.isfinite(issue) & keep)
    keep_rows = None if ok.all() else ok
    cols = _subset(st.coll_cols, keep_rows)
    offset = st.coll_peer_offset
    if keep_rows is not None:
        issue, start, end, offset = issue[ok], start[ok], end[ok], offset[ok]
    start = np.where(np.isfinite(start), start, issue)
    n = len(issue)
    arrays = {
        **cols,
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        "peer": pa.array(np.where(offset == 0, -1, rank + offset).astype(np.int32)),
        "issue_ns": _time_array(issue, base_ns),
        "start_ns": _time_array(start, base_ns),
        "end_ns": _time_array(end, base_ns),
    }
    schema = TABLES["collectives"]
    return pa.Table.from_arrays([arrays[f.name] for f in schema], schema=schema)
