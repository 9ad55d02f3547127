"""A flush's digests: the ``digests`` rows (docs/spec.md §2) of the spans and collectives one
flush writes, made with pyarrow while the rows are in memory (no DuckDB in the training
process).

The columns are what analyzer/sql/digest/collectives.sql and spans.sql compute, per (rank,
step, channel) of the flush's rows only: counts, sums, minima and maxima, which the analyzer
adds up again over the flushes (analyzer/sql/digest/combine_*.sql), so a step written over two
flushes, or a collective written unfinished then finished, reads exactly as from the raw rows
(tests/test_digests.py compares both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tracer.rundir import to_table
from tracer.schema import TABLES

_BUS_ALL_REDUCE = ("all_reduce",)
_BUS_SHARDED = ("all_gather", "reduce_scatter", "all_to_all")


def _table(name: str, columns: Mapping[str, Sequence[Any]] | pa.Table) -> pa.Table:
    if isinstance(columns, pa.Table):
        return columns
    return to_table(name, columns)


def _where(mask: pa.Array, values: pa.Array) -> pa.Array:
    """``values`` where ``mask`` holds (a null mask counts as false), else null."""
    return pc.if_else(pc.fill_null(mask, False), values, pa.nulls(len(values), values.type))


def collectives_digest(columns: Mapping[str, Sequence[Any]] | pa.Table) -> pa.Table:
    """digest/collectives.sql over these rows (no `untimed` wait estimate), as digests rows."""
    t = _table("collectives", columns)
    op, source = t["op"], t["source"]
    issue, start, end = t["issue_ns"], t["start_ns"], t["end_ns"]
    host = pc.fill_null(pc.equal(source, "host"), False)
    p2p = pc.fill_null(pc.is_in(op, pa.array(["send", "recv"])), False)
    send = pc.equal(op, "send")
    arrival = pc.if_else(pc.or_(p2p, host), issue, pc.coalesce(start, issue))
    from_ns = pc.coalesce(_where(send, pc.coalesce(start, issue)), _where(host, start), arrival)
    n = pc.cast(t["group_size"], pa.float64())
    n = _where(pc.greater(n, 0.0), n)
    factor = pc.if_else(
        pc.fill_null(pc.is_in(op, pa.array(_BUS_ALL_REDUCE)), False),
        pc.divide(pc.multiply(pc.subtract(n, 1.0), 2.0), n),
        pc.if_else(
            pc.fill_null(pc.is_in(op, pa.array(_BUS_SHARDED)), False),
            pc.divide(pc.subtract(n, 1.0), n),
            pa.scalar(1.0),
        ),
    )
    done_bytes = _where(pc.is_valid(end), t["nbytes"])
    keyed = pa.table(
        {
            "rank": t["rank"],
            "step": t["step"],
            "group": t["group"],
            "peer": t["peer"],
            "is_send": pc.cast(send, pa.int32()),
            "end": end,
            "ones": pa.array([1] * len(t), pa.int64()),
            "busy": pc.subtract(end, from_ns),
            "arrival": arrival,
            "done_bytes": done_bytes,
            "bus": pc.multiply(pc.cast(done_bytes, pa.float64()), factor),
        }
    )
    g = keyed.group_by(["rank", "step", "group", "peer", "is_send"], use_threads=False).aggregate(
        [
            ("ones", "sum"),
            ("end", "count"),
            ("busy", "sum"),
            ("arrival", "min"),
            ("end", "max"),
            ("done_bytes", "sum"),
            ("bus", "sum"),
        ]
    )
    return _rows(
        g,
        "collectives",
        {
            "busy_ns": "busy_sum",
            "first_ns": "arrival_min",
            "last_ns": "end_max",
            "nbytes": "done_bytes_sum",
            "bus_bytes": "bus_sum",
        },
    )


def spans_digest(columns: Mapping[str, Sequence[Any]] | pa.Table) -> pa.Table:
    """digest/spans.sql over these rows, as digests rows."""
    t = _table("spans", columns)
    start, end, kind, name = t["start_ns"], t["end_ns"], t["kind"], t["name"]
    length = pc.subtract(end, start)
    compute = pc.and_(pc.equal(kind, "compute"), pc.not_equal(name, "recompute"))
    step = pc.equal(name, "step")
    keyed = pa.table(
        {
            "rank": t["rank"],
            "step": t["step"],
            "end": end,
            "ones": pa.array([1] * len(t), pa.int64()),
            "compute": _where(compute, length),
            "data": _where(pc.equal(kind, "data"), length),
            "step_span": _where(step, length),
            "step_runq": _where(pc.and_(step, pc.equal(kind, "host")), t["runq_ns"]),
            "first": _where(pc.is_valid(end), start),
            "ts": pc.coalesce(end, start),
        }
    )
    g = keyed.group_by(["rank", "step"], use_threads=False).aggregate(
        [
            ("ones", "sum"),
            ("end", "count"),
            ("compute", "sum"),
            ("data", "sum"),
            ("step_span", "max"),
            ("step_runq", "max"),
            ("first", "min"),
            ("end", "max"),
            ("ts", "max"),
        ]
    )
    return _rows(
        g,
        "spans",
        {
            "compute_ns": "compute_sum",
            "data_ns": "data_sum",
            "step_span_ns": "step_span_max",
            "step_runq_ns": "step_runq_max",
            "first_ns": "first_min",
            "last_ns": "end_max",
            "last_ts_ns": "ts_max",
        },
    )


def _rows(g: pa.Table, kind: str, names: dict[str, str | None]) -> pa.Table:
    """The aggregates ``g`` as digests rows of ``kind`` (absent columns null)."""
    names = {**names, "n_rows": "ones_sum", "n_done": "end_count"}
    cols = {}
    n = g.num_rows
    for f in TABLES["digests"]:
        if f.name in ("rank", "step", "group", "peer", "is_send") and f.name in g.column_names:
            cols[f.name] = g[f.name].cast(f.type)
        elif f.name == "kind":
            cols[f.name] = pa.array([kind] * n, pa.string())
        elif names.get(f.name):
            cols[f.name] = g[names[f.name]].cast(f.type)
        else:
            cols[f.name] = pa.nulls(n, f.type)
    return pa.table(cols, schema=TABLES["digests"])


def flush_digests(
    collectives: Mapping[str, Sequence[Any]] | pa.Table | None,
    spans: Mapping[str, Sequence[Any]] | pa.Table | None,
) -> pa.Table | None:
    """The digests rows of one flush's written columns (None: no rows)."""
    parts = []
    if collectives is not None and len(collectives["rank"]):
        parts.append(collectives_digest(collectives))
    if spans is not None and len(spans["rank"]):
        parts.append(spans_digest(spans))
    return pa.concat_tables(parts) if parts else None
