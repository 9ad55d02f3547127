"""Turning the replayed step times into per-rank Arrow tables.

Every row the simulator writes happens on all ranks of one pipeline stage at once: one forward
span of microbatch 3 on stage 1, one tp all_gather with seq 17 on stage 1. So a row is one
entry of the stage's row layout (:class:`analyzer.synth.stepgraph.Rows`: its static columns,
its times as references to the step graph's blocks) and, per step, one array of times over the
stage's ranks, taken from the replay's starts and ends. Writing a rank's table then takes the
static columns as they are (shared by every rank of the stage) and one column of the stacked
time arrays.

Times are float64 seconds since the run's start; ``inf`` means "never happened" (a rank that
is hung or waits on one). A row is kept when its start is finite; an end that is infinite
becomes a null ``end_ns`` (the rank was still waiting when the run was stopped).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from analyzer.synth.stepgraph import Rows
from tracer.schema import TABLES


class StageRows:
    """A stage's row layout and, for the steps of the chunk being replayed, its rows' times,
    stored as the writer reads them: ``(ranks, rows)``, the rows of step after step."""

    def __init__(self, rows: Rows, pair: np.ndarray) -> None:
        self.rows = rows
        self.span_first, self.span_last = (
            np.array([b[k] for b in rows.span_blocks], dtype=np.int64).reshape(-1) for k in (0, 1)
        )
        self.coll = np.array(rows.coll_blocks, dtype=np.int64)
        p2p = pair[self.coll] != self.coll
        self.p2p_at, self.p2p_other = np.flatnonzero(p2p), pair[self.coll[p2p]]
        self.steps: list[int] = []
        self.capacity = 0

    def begin(self, steps: int, ranks: int) -> None:
        """Start a chunk of up to ``steps`` steps (the buffers are kept from chunk to chunk)."""
        self.steps = []
        if steps > self.capacity:
            ns, nc, npair = len(self.span_first), len(self.coll), len(self.p2p_at)
            self.span = [np.empty((ranks, steps * ns)) for _ in range(2)]
            self.coll_t = [np.empty((ranks, steps * nc)) for _ in range(2)]
            self.pair = np.empty((ranks, steps * npair))
            self.capacity = steps

    def add(self, step: int, start: np.ndarray, end: np.ndarray) -> None:
        """Take one step's row times from the replay's ``start``/``end`` (``(blocks, R)``)."""
        k = len(self.steps)
        self.steps.append(step)

        def put(out: np.ndarray, values: np.ndarray) -> None:
            n = values.shape[0]
            out[:, k * n : (k + 1) * n] = values.T

        put(self.span[0], start[self.span_first])
        put(self.span[1], end[self.span_last])
        put(self.coll_t[0], start[self.coll])
        put(self.coll_t[1], end[self.coll])
        put(self.pair, np.maximum(start[self.coll[self.p2p_at]], start[self.p2p_other]))

    def tables(self) -> StageTables:
        """The chunk's tables (views of the buffers: write them before the next chunk)."""
        steps = np.array(self.steps, dtype=np.int64)
        k = len(steps)
        spans = self.rows.spans
        n_sp = len(spans)

        def tile(values, dtype=None) -> pa.Array:
            arr = np.tile(np.array(values, dtype=dtype or object), k)
            return pa.array(arr, type=pa.string()) if dtype is None else pa.array(arr)

        span_cols = {
            "step": pa.array(np.repeat(steps, n_sp).astype(np.int32)),
            "microbatch": tile([r.mb for r in spans], np.int32),
            "name": tile([r.name for r in spans]),
            "kind": tile([r.kind for r in spans]),
            "source": tile([r.source for r in spans]),
        }
        colls = self.rows.colls
        n_c = len(colls)
        seq = np.array([r.seq0 for r in colls], dtype=np.int64) + steps[:, None] * np.array(
            [r.dseq for r in colls], dtype=np.int64
        )
        coll_cols = {
            "step": pa.array(np.repeat(steps, n_c).astype(np.int32)),
            "microbatch": tile([r.mb for r in colls], np.int32),
            "op": tile([r.op for r in colls]),
            "group": tile([r.group for r in colls]),
            "group_size": tile([r.size for r in colls], np.int32),
            "seq": pa.array(seq.reshape(-1)),
            "nbytes": tile([r.nbytes for r in colls], np.int64),
            "dtype": pa.array(["bfloat16"] * (k * n_c), type=pa.string()),
            "source": pa.array(["cuda"] * (k * n_c), type=pa.string()),
        }
        n_p = len(self.p2p_at)
        st = StageTables(
            span_cols=span_cols,
            span_times=(self.span[0][:, : k * n_sp], self.span[1][:, : k * n_sp]),
            coll_cols=coll_cols,
            coll_peer_offset=np.tile(np.array([r.peer for r in colls], dtype=np.int64), k),
            coll_times=(self.coll_t[0][:, : k * n_c], self.coll_t[1][:, : k * n_c]),
            pair_rows=(self.p2p_at + n_c * np.arange(k)[:, None]).reshape(-1),
            pair_start=self.pair[:, : k * n_p],
        )
        return st


def to_ns(t: np.ndarray, base_ns: int, finite: np.ndarray | None = None) -> np.ndarray:
    """Seconds since the start as int64 epoch nanoseconds; the infinite ones (``finite``
    False, computed when not given) read as the start (callers mask them)."""
    x = t * 1e9
    np.rint(x, out=x)
    finite = np.isfinite(t) if finite is None else finite
    if not finite.all():
        np.copyto(x, 0.0, where=~finite)
    ns = x.astype(np.int64)
    ns += base_ns
    return ns


@dataclass
class StageTables:
    """A stage's rows of a chunk: static columns as Arrow arrays, times as (ranks, rows)."""

    span_cols: dict[str, pa.Array]
    span_times: tuple[np.ndarray, np.ndarray]  # start, end
    coll_cols: dict[str, pa.Array]
    coll_peer_offset: np.ndarray
    coll_times: tuple[np.ndarray, np.ndarray]  # issue (also the start), end
    pair_rows: np.ndarray  # the send/recv rows, whose start is the pair's later posting
    pair_start: np.ndarray  # (ranks, pair rows)


def _time_array(t: np.ndarray, base_ns: int) -> pa.Array:
    finite = np.isfinite(t)
    return pa.array(to_ns(t, base_ns), mask=None if finite.all() else ~finite)


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
    return pa.Table.from_arrays(
        [arrays[f.name] if f.name in arrays else pa.nulls(n, f.type) for f in schema],
        schema=schema,
    )


def rank_collectives(
    st: StageTables, j: int, rank: int, base_ns: int, keep: np.ndarray | None
) -> pa.Table:
    """Collectives of the ``j``-th rank of a stage. A row whose transfer never began (it
    waits on a peer that never came) keeps its issue time as start and a null end."""
    issue, end = (t[j] for t in st.coll_times)
    start = issue.copy()
    start[st.pair_rows] = st.pair_start[j]
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
