"""Writing the simulated run in the compacted layout: one file per pipeline stage and table.

``megascope compact`` turns a traced run's per-rank folders into ``TABLE/ranks=L-H/`` folders
of one file each (docs/spec.md §2). The simulator can write that layout directly: every row
it writes belongs to one stage, and a stage's ranks are the contiguous block ``L..H``, so a
chunk of steps of a whole stage becomes one Arrow table, built from the stage's time arrays
in a few vectorized passes and appended to the stage's file as row groups of DuckDB's size.
At 12,288 ranks that is a few dozen files instead of 61k, written at the speed of the
compressor, not of file creation.

The rows are exactly those of the per-rank layout (:mod:`analyzer.synth.writer`), values
included (a GPU sample's noise comes from the same per-rank generator), in rank order within
each chunk of steps; collectives in rank order within each kind of channel (``group``), a kind
at a time, so that no row group mixes kinds (docs/spec.md §2). A file appears complete: it is written under a hidden temporary name
and renamed when the run ends.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from analyzer.synth.config import HwClassRange
from analyzer.synth.record import StageTables, to_ns
from analyzer.synth.writer import (
    HANG_THREAD,
    ChunkJob,
    Waiting,
    WriteState,
    gpu_noise,
    gpu_table,
    stack_frames,
    topology_columns,
)
from tracer.rundir import parquet_options, ranks_dir
from tracer.schema import TABLES

ROW_GROUP_ROWS = 122_880  # as megascope compact writes: DuckDB's unit of parallel scanning
_NEVER = np.iinfo(np.int64).max
_NONE = np.iinfo(np.int64).min


class RangeWriter:
    """One open Parquet file per (table, stage), appended chunk by chunk, renamed on close."""

    def __init__(self, run_dir: str, stage_size: int) -> None:
        self.run_dir, self.size = run_dir, stage_size
        self._open: dict[tuple[str, int], tuple[pq.ParquetWriter, str, str]] = {}
        self._lock = threading.Lock()

    def write(self, table: str, lo: int, data: pa.Table, state: WriteState) -> None:
        """Append ``data`` (rows of ranks ``lo``..``lo + stage_size - 1``) to its file."""
        state.wrote(table, data.num_rows)
        key = (table, lo)
        with self._lock:
            if key not in self._open:
                folder = ranks_dir(self.run_dir, table, lo, lo + self.size - 1)
                os.makedirs(folder, exist_ok=True)
                final = os.path.join(folder, "part-000000.parquet")
                tmp = os.path.join(folder, f".part-000000.parquet.{os.getpid()}.tmp")
                # store_schema=False: dictionary-typed string columns read back as strings
                opts = parquet_options(data.column_names)
                writer = pq.ParquetWriter(tmp, data.schema, store_schema=False, **opts)
                self._open[key] = (writer, tmp, final)
        writer = self._open[key][0]
        if table != "collectives":
            writer.write_table(data, row_group_size=ROW_GROUP_ROWS)
            return
        # a channel kind at a time, so that no row group mixes kinds: a reader of one kind
        # (the data-parallel rows of a group, Run.restricted) skips the others' row groups by
        # their statistics
        for channel in sorted(pc.unique(data["group"]).to_pylist(), key=str):
            rows = data.filter(
                pc.is_null(data["group"]) if channel is None else pc.equal(data["group"], channel)
            )
            writer.write_table(rows, row_group_size=ROW_GROUP_ROWS)

    def close(self) -> None:
        """Finish every file and give it its final name."""
        for writer, tmp, final in self._open.values():
            writer.close()
            os.replace(tmp, final)
        self._open.clear()

    def abort(self) -> None:
        """Remove the files not yet finished (the run failed to simulate)."""
        for writer, tmp, _ in self._open.values():
            writer.close()
            os.remove(tmp)
        self._open.clear()


def _table(name: str, cols: dict[str, pa.Array]) -> pa.Table:
    """The table's columns in SPEC order (strings may be dictionary-encoded)."""
    n = len(next(iter(cols.values())))
    arrays = [cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in TABLES[name]]
    return pa.Table.from_arrays(arrays, names=TABLES[name].names)


def _encoded(cols: dict[str, pa.Array]) -> dict[str, pa.Array]:
    """String columns dictionary-encoded: taking rows then moves indices, not strings."""
    return {k: v.dictionary_encode() if pa.types.is_string(v.type) else v for k, v in cols.items()}


def _lost(job: ChunkJob, ranks: np.ndarray) -> np.ndarray | None:
    """Per rank, the first step whose rows a crash lost (None: no rank of these lost any)."""
    lost = np.array([job.keep_before.get(int(r), _NEVER) for r in ranks], dtype=np.int64)
    return None if (lost == _NEVER).all() else lost


def _kept(start: np.ndarray, steps: np.ndarray, lost: np.ndarray | None) -> np.ndarray:
    ok = np.isfinite(start)
    if lost is not None:
        ok &= steps[None, :] < lost[:, None]
    return ok


def _rows_max(values: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Per rank (row), the largest of ``values`` where ``ok`` (``_NONE`` where none)."""
    if not values.shape[1]:
        return np.full(len(ok), _NONE)
    return (values if ok.all() else np.where(ok, values, _NONE)).max(axis=1)


class _Rows:
    """The kept entries of a stage's (ranks, rows) arrays, in rank-major order: all of them
    (the usual case, taken without copying) or those where ``ok``."""

    def __init__(self, ok: np.ndarray) -> None:
        self.shape = ok.shape
        self.flat = None if ok.all() else np.flatnonzero(ok)

    def pick(self, matrix: np.ndarray) -> np.ndarray:
        """The kept entries of a (ranks, rows) array."""
        flat = matrix.reshape(-1)
        return flat if self.flat is None else flat[self.flat]

    def static(self, column: pa.Array) -> pa.Array:
        """A column the stage's ranks share (one value per row), for every kept entry."""
        ranks, n = self.shape
        if self.flat is not None:
            return column.take(pa.array(self.flat % n))
        if isinstance(column, pa.DictionaryArray):
            idx = np.tile(column.indices.to_numpy(zero_copy_only=False), ranks)
            return pa.DictionaryArray.from_arrays(pa.array(idx), column.dictionary)
        return pa.array(np.tile(column.to_numpy(zero_copy_only=False), ranks), column.type)

    def times(self, ns: np.ndarray, finite: np.ndarray) -> pa.Array:
        """A time column: the kept entries of ``ns``, null where not ``finite``."""
        known = self.pick(finite)
        return pa.array(self.pick(ns), mask=None if known.all() else ~known)


class _Stage:
    """One stage's chunk as whole-stage tables (the per-rank layout's rows, rank after rank)."""

    def __init__(self, job: ChunkJob, st: StageTables, first_rank: int) -> None:
        self.job, self.st = job, st
        self.ranks = first_rank + np.arange(st.span_times[0].shape[0], dtype=np.int64)
        self.lost = _lost(job, self.ranks)

    def spans(self) -> tuple[pa.Table, np.ndarray, np.ndarray, np.ndarray]:
        """The spans, and (ranks, rows) arrays for what follows: kept, start and end ns."""
        st, base = self.st, self.job.base_ns
        start, end = st.span_times
        ok = _kept(start, st.span_cols["step"].to_numpy(), self.lost)
        rows = _Rows(ok)
        cols = {k: rows.static(v) for k, v in _encoded(st.span_cols).items()}
        n = start.shape[1]
        cols["rank"] = pa.array(rows.pick(np.repeat(self.ranks, n)).astype(np.int32))
        end_known = np.isfinite(end)
        start_ns, end_ns = to_ns(start, base), to_ns(end, base, end_known)
        cols["start_ns"] = rows.times(start_ns, ok)
        cols["end_ns"] = rows.times(end_ns, end_known)
        return _table("spans", cols), ok, start_ns, end_ns

    def collectives(self) -> tuple[pa.Table, np.ndarray, np.ndarray, np.ndarray]:
        """The collectives, and (ranks, rows) arrays: kept, end ns, and whether the end is known."""
        st, base = self.st, self.job.base_ns
        issue, end = st.coll_times
        start = issue.copy()
        start[:, st.pair_rows] = st.pair_start
        ok = _kept(issue, st.coll_cols["step"].to_numpy(), self.lost)
        start_known = np.isfinite(start)
        if not start_known.all():
            np.copyto(start, issue, where=~start_known)
        rows = _Rows(ok)
        cols = {k: rows.static(v) for k, v in _encoded(st.coll_cols).items()}
        offset = st.coll_peer_offset[None, :]
        rank = self.ranks[:, None]
        cols["rank"] = pa.array(rows.pick(np.broadcast_to(rank, ok.shape)).astype(np.int32))
        peer = np.where(offset == 0, -1, rank + offset).astype(np.int32)
        cols["peer"] = pa.array(rows.pick(peer))
        issue_known, end_known = np.isfinite(issue), np.isfinite(end)
        cols["issue_ns"] = rows.times(to_ns(issue, base, issue_known), issue_known)
        cols["start_ns"] = rows.times(to_ns(start, base), np.isfinite(start))
        end_ns = to_ns(end, base, end_known)
        cols["end_ns"] = rows.times(end_ns, end_known)
        return _table("collectives", cols), ok, end_ns, end_known

    def heartbeats(self, ok: np.ndarray, start_ns: np.ndarray) -> pa.Table:
        is_step = self._is_step()
        flat = np.flatnonzero(ok & is_step[None, :])
        n = ok.shape[1]
        steps = self.st.span_cols["step"].to_numpy()
        cols = {
            "rank": pa.array(self.ranks[flat // n].astype(np.int32)),
            "ts_ns": pa.array(start_ns.reshape(-1)[flat]),
            "step": pa.array(steps[flat % n]),
            "state": pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(len(flat), dtype=np.int32)), pa.array(["step"])
            ),
        }
        return _table("heartbeats", cols)

    def gpu(
        self, ok: np.ndarray, start_ns: np.ndarray, end: np.ndarray, end_ns: np.ndarray
    ) -> pa.Table:
        """One sample per completed step per rank, as the per-rank writer makes it (the same
        generator per rank and chunk, drawn by the same :func:`gpu_noise`)."""
        job = self.job
        done = ok & self._is_step()[None, :] & np.isfinite(end)
        counts = done.sum(axis=1)
        flat = np.flatnonzero(done)
        n = ok.shape[1]
        step = self.st.span_cols["step"].to_numpy()[flat % n]
        s0 = start_ns.reshape(-1)[flat]
        ts = s0 + (end_ns.reshape(-1)[flat] - s0) // 2
        total = len(flat)
        draws = [np.empty(total) for _ in range(5)]
        factor = np.ones(total)
        at = 0
        for rank, c in zip(self.ranks.tolist(), counts.tolist(), strict=True):
            rng = np.random.default_rng([job.seed, rank, job.part])
            for out, drawn in zip(draws, gpu_noise(rng, c), strict=True):
                out[at : at + c] = drawn
            for f, from_step in job.throttle.get(rank, []):
                seg = slice(at, at + c)
                factor[seg] = np.where(step[seg] >= from_step, factor[seg] * f, factor[seg])
            at += c
        return gpu_table(np.repeat(self.ranks, counts), ts, factor, tuple(draws))

    def _is_step(self) -> np.ndarray:
        names = self.st.span_cols["name"]
        return np.asarray(names.to_numpy(zero_copy_only=False) == "step", dtype=bool)


def _learn(
    stage: _Stage,
    span_ok: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    span_end: np.ndarray,
    coll: tuple[pa.Table, np.ndarray, np.ndarray, np.ndarray],
    state: WriteState,
) -> None:
    """What :func:`analyzer.synth.writer._write_rank` learns per rank, for the whole stage."""
    _, c_ok, c_end_ns, c_done = coll
    latest = np.maximum(
        np.maximum(
            _rows_max(start_ns, span_ok), _rows_max(end_ns, span_ok & np.isfinite(span_end))
        ),
        _rows_max(c_end_ns, c_ok & c_done),
    )
    steps = stage.st.span_cols["step"].to_numpy().astype(np.int64)
    last_step = _rows_max(np.broadcast_to(steps, span_ok.shape), span_ok)
    for j, rank in enumerate(stage.ranks.tolist()):
        if latest[j] != _NONE and latest[j] > state.last_ns.get(rank, 0):
            state.last_ns[rank] = int(latest[j])
        if last_step[j] != _NONE:
            state.last_step[rank] = int(last_step[j])
    open_rows = c_ok & ~c_done
    if not open_rows.any():
        return
    cols = stage.st.coll_cols
    issue = stage.st.coll_times[0]
    ops = np.asarray(cols["op"].to_numpy(zero_copy_only=False))
    for at in np.flatnonzero(open_rows.any(axis=1)):
        mine = np.flatnonzero(open_rows[at])
        blocking = mine[ops[mine] != "send"]  # sends do not block
        mine = blocking if len(blocking) else mine
        last = int(mine[np.argmax(to_ns(issue[at, mine], stage.job.base_ns))])
        row = {k: cols[k][last].as_py() for k in ("op", "group", "seq", "step")}
        state.waiting[int(stage.ranks[at])] = Waiting(**row)


def _write_one_stage(
    writer: RangeWriter, job: ChunkJob, st: StageTables, first_rank: int, state: WriteState
) -> None:
    stage = _Stage(job, st, first_rank)
    spans, span_ok, start_ns, end_ns = stage.spans()
    writer.write("spans", first_rank, spans, state)
    del spans
    coll = stage.collectives()
    writer.write("collectives", first_rank, coll[0], state)
    writer.write("heartbeats", first_rank, stage.heartbeats(span_ok, start_ns), state)
    if job.gpu:
        gpu = stage.gpu(span_ok, start_ns, st.span_times[1], end_ns)
        writer.write("gpu", first_rank, gpu, state)
    if job.work is not None:
        positions = np.arange(len(stage.ranks))
        writer.write("work", first_rank, job.work.table(first_rank, positions, stage.lost), state)
    _learn(stage, span_ok, start_ns, end_ns, st.span_times[1], coll, state)


def write_chunk(
    writer: RangeWriter, job: ChunkJob, stages: list[StageTables], state: WriteState
) -> None:
    """Write one chunk of steps of every stage, ``job.jobs`` stages at a time."""
    size = writer.size
    if job.jobs <= 1:
        for s, st in enumerate(stages):
            _write_one_stage(writer, job, st, s * size, state)
        return
    with ThreadPoolExecutor(max_workers=job.jobs) as pool:
        futures = [
            pool.submit(_write_one_stage, writer, job, st, s * size, state)
            for s, st in enumerate(stages)
        ]
        for f in futures:
            f.result()


def write_topology(
    writer: RangeWriter,
    mesh: dict[str, int],
    world: int,
    state: WriteState,
    hosts: tuple[str, ...] = (),
    classes: tuple[HwClassRange, ...] = (),
) -> None:
    """The topology rows of :func:`analyzer.synth.writer.write_topology`, a file per stage."""
    for lo in range(0, world, writer.size):
        cols = topology_columns(mesh, range(lo, lo + writer.size), hosts, classes)
        writer.write("topology", lo, _table("topology", cols), state)


def write_hang(writer: RangeWriter, timeout_s: float, hung: set[int], state: WriteState) -> int:
    """:func:`analyzer.synth.writer.write_hang` in this layout: the watchdogs' heartbeats end
    each stage's heartbeats file, their stacks make a stacks file per stage."""
    latest = 0
    by_stage: dict[int, list[int]] = {}
    for rank in sorted(state.last_ns):
        by_stage.setdefault(rank // writer.size * writer.size, []).append(rank)
    for lo, ranks in by_stage.items():
        ts = [state.last_ns[r] + int(timeout_s * 1e9) for r in ranks]
        latest = max([latest, *ts])
        beats = {
            "rank": pa.array(ranks, pa.int32()),
            "ts_ns": pa.array(ts, pa.int64()),
            "step": pa.array([state.last_step.get(r, 0) for r in ranks], pa.int32()),
            "state": pa.array(["hang"] * len(ranks)).dictionary_encode(),
        }
        writer.write("heartbeats", lo, _table("heartbeats", beats), state)
        stacks = {
            "rank": pa.array(ranks, pa.int32()),
            "ts_ns": pa.array(ts, pa.int64()),
            "reason": pa.array(["hang"] * len(ranks)),
            "thread": pa.array([HANG_THREAD] * len(ranks)),
            "stack": pa.array(["\n".join(stack_frames(r, hung, state)) for r in ranks]),
        }
        writer.write("stacks", lo, _table("stacks", stacks), state)
    return latest
