"""The run directory's tables (docs/spec.md §2) as Arrow schemas.

This module is the one place the columns are written down. It imports only pyarrow, so the
analyzer, the simulator and the importers (which never import torch) share it with the tracer.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

TABLES: dict[str, pa.Schema] = {
    "topology": pa.schema(
        [
            ("rank", pa.int32()),
            ("host", pa.string()),
            ("local_rank", pa.int32()),
            ("pid", pa.int32()),
            ("device", pa.string()),
            ("gpu_uuid", pa.string()),
            ("dp", pa.int32()),
            ("pp", pa.int32()),
            ("tp", pa.int32()),
            ("cp", pa.int32()),
            ("clock_offset_ns", pa.int64()),
            # the rank's hardware class (tracer/hwclass.py): null where not known (older
            # runs, importers, a CPU rank's NVML fields)
            ("device_name", pa.string()),
            ("device_mem_bytes", pa.int64()),
            ("cpu_model", pa.string()),
            ("max_sm_clock_mhz", pa.int32()),
            ("max_mem_clock_mhz", pa.int32()),
            ("power_limit_w", pa.float32()),
            ("hw_class", pa.string()),
        ]
    ),
    "spans": pa.schema(
        [
            ("rank", pa.int32()),
            ("step", pa.int32()),
            ("microbatch", pa.int32()),
            ("name", pa.string()),
            ("kind", pa.string()),
            ("start_ns", pa.int64()),
            ("end_ns", pa.int64()),
            ("source", pa.string()),
            # CPU time of the thread that drew a host-timed span, inside it (null where not
            # measured: device-timed spans, importers): own work that no wait for a core or a
            # peer lengthens, where ranks share cores (docs/spec.md §2)
            ("cpu_ns", pa.int64()),
            # and the time that thread waited, runnable, for a core inside it (Linux's run-queue
            # delay; null where cpu_ns is, or the system does not say): what the host's
            # scheduler, not the rank's work, added to the span
            ("runq_ns", pa.int64()),
            # an offload span's transfer (docs/spec.md §2): its bytes, its direction
            # (d2h|h2d|host_update) and the stream or thread it ran on; null on other spans
            ("nbytes", pa.int64()),
            ("direction", pa.string()),
            ("stream", pa.string()),
        ]
    ),
    "collectives": pa.schema(
        [
            ("rank", pa.int32()),
            ("step", pa.int32()),
            ("microbatch", pa.int32()),
            ("op", pa.string()),
            ("group", pa.string()),
            ("group_size", pa.int32()),
            ("seq", pa.int64()),
            ("peer", pa.int32()),
            ("nbytes", pa.int64()),
            ("dtype", pa.string()),
            ("issue_ns", pa.int64()),
            ("start_ns", pa.int64()),
            ("end_ns", pa.int64()),
            ("source", pa.string()),
        ]
    ),
    "gpu": pa.schema(
        [
            ("rank", pa.int32()),
            ("ts_ns", pa.int64()),
            ("sm_clock_mhz", pa.int32()),
            ("mem_clock_mhz", pa.int32()),
            ("power_w", pa.float32()),
            ("temp_c", pa.float32()),
            ("util_gpu", pa.float32()),
            ("mem_used_bytes", pa.int64()),
            ("throttle_reasons", pa.int64()),
            ("pcie_tx_bps", pa.float64()),
            ("pcie_rx_bps", pa.float64()),
            ("ecc_errors", pa.int64()),
        ]
    ),
    "heartbeats": pa.schema(
        [
            ("rank", pa.int32()),
            ("ts_ns", pa.int64()),
            ("step", pa.int32()),
            ("state", pa.string()),
        ]
    ),
    "stacks": pa.schema(
        [
            ("rank", pa.int32()),
            ("ts_ns", pa.int64()),
            ("reason", pa.string()),
            ("thread", pa.string()),
            ("stack", pa.string()),
        ]
    ),
    # The work a rank was given, beside the time it took (docs/spec.md §2): tokens, attention
    # work, tokens per expert, bytes each all_to_all sent to each peer.
    "work": pa.schema(
        [
            ("rank", pa.int32()),
            ("step", pa.int32()),
            ("microbatch", pa.int32()),
            ("kind", pa.string()),
            ("key", pa.int32()),
            ("value", pa.int64()),
            ("group", pa.string()),
            ("seq", pa.int64()),
        ]
    ),
    # Derived from spans and collectives by their writer (docs/spec.md §2, analyzer/digests.py):
    # one row per (rank, step, kind, channel), sums, minima and maxima that a reader adds up
    # again with a group by, so a step written over two flushes combines exactly.
    "digests": pa.schema(
        [
            ("rank", pa.int32()),
            ("step", pa.int32()),
            ("kind", pa.string()),
            ("group", pa.string()),
            ("peer", pa.int32()),
            ("is_send", pa.int32()),
            ("n_rows", pa.int64()),
            ("n_done", pa.int64()),
            ("busy_ns", pa.int64()),
            ("first_ns", pa.int64()),
            ("last_ns", pa.int64()),
            ("last_ts_ns", pa.int64()),
            ("nbytes", pa.int64()),
            ("bus_bytes", pa.float64()),
            ("compute_ns", pa.int64()),
            ("data_ns", pa.int64()),
            ("step_span_ns", pa.int64()),
            ("step_runq_ns", pa.int64()),
        ]
    ),
}


def row_columns(table: str) -> tuple[str, ...]:
    """The columns of the tracer's rows of ``table``, in order: the table's columns without
    ``rank`` (the writer adds the rank: tracer/writer.py)."""
    return tuple(f.name for f in TABLES[table] if f.name != "rank")


def row_index(table: str, column: str) -> int:
    """Where ``column`` sits in the tracer's rows of ``table`` (read once, at import: the
    position classes below hold the result as plain ints)."""
    return row_columns(table).index(column)


class C:
    """Positions in a ``collectives`` row of the tracer (``row[C.seq]``), read from the schema
    at import: adding a column moves them with it. ``pg`` is past the written columns: an
    in-flight row's process group, which :meth:`tracer.collectives.Recorder.complete` cuts
    off (``row[: C.width]``)."""

    step = row_index("collectives", "step")
    microbatch = row_index("collectives", "microbatch")
    op = row_index("collectives", "op")
    group = row_index("collectives", "group")
    group_size = row_index("collectives", "group_size")
    seq = row_index("collectives", "seq")
    peer = row_index("collectives", "peer")
    nbytes = row_index("collectives", "nbytes")
    dtype = row_index("collectives", "dtype")
    issue_ns = row_index("collectives", "issue_ns")
    start_ns = row_index("collectives", "start_ns")
    end_ns = row_index("collectives", "end_ns")
    source = row_index("collectives", "source")
    width = len(row_columns("collectives"))  # the written columns
    pg = width


class S:
    """Positions in a ``spans`` row of the tracer (``row[S.start_ns]``), read from the schema."""

    step = row_index("spans", "step")
    microbatch = row_index("spans", "microbatch")
    name = row_index("spans", "name")
    kind = row_index("spans", "kind")
    start_ns = row_index("spans", "start_ns")
    end_ns = row_index("spans", "end_ns")
    source = row_index("spans", "source")
    cpu_ns = row_index("spans", "cpu_ns")


class W:
    """Positions in a ``work`` row of the tracer (``row[W.group]``), read from the schema."""

    step = row_index("work", "step")
    microbatch = row_index("work", "microbatch")
    kind = row_index("work", "kind")
    key = row_index("work", "key")
    value = row_index("work", "value")
    group = row_index("work", "group")
    seq = row_index("work", "seq")


def make_row(table: str, **values: object) -> tuple[object, ...]:
    """A tracer row of ``table`` from its columns by name, null where not given (off the hot
    path: the hot path writes its row literals in :func:`row_columns` order)."""
    unknown = set(values) - set(row_columns(table))
    if unknown:
        raise KeyError(f"{table} has no column {sorted(unknown)}")
    return tuple(values.get(name) for name in row_columns(table))


# columns a writer may leave out (written null): measures some sources have and others not
OPTIONAL: dict[str, tuple[str, ...]] = {
    "spans": ("cpu_ns", "runq_ns", "nbytes", "direction", "stream"),
    "topology": ("device_name", "device_mem_bytes", "cpu_model", "max_sm_clock_mhz",
                 "max_mem_clock_mhz", "power_limit_w", "hw_class"),
}  # fmt: skip

# tables the tracer derives from its other tables at each flush, not rows it records
DERIVED_TABLES = ("digests",)

# kind of a work row: ``tokens`` and ``attention`` (sum of squared document lengths) of the
# microbatch the rank's data-parallel replica trains on; ``expert_tokens`` (key: the global
# expert id) routed to an expert this rank holds; ``a2a_sent`` (key: the peer's global rank;
# group and seq: the all_to_all's, as in collectives) bytes an all_to_all sent to one peer
WORK_KINDS = ("tokens", "attention", "expert_tokens", "a2a_sent")

# background: work on a thread beside the training loop (an asynchronous checkpoint's write),
# which holds no step up: the step digests and the what-if leave it out
SPAN_KINDS = ("compute", "comm", "data", "host", "memory", "background")
COLLECTIVE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send",
    "recv",
    "barrier",
    # Ops torch offers beyond the SPEC's list; recorded under their own names.
    "reduce",
    "gather",
    "scatter",
)
RUN_STATUSES = ("running", "finished", "failed", "hung")


def table_glob(run_dir: str, table: str) -> str:
    """The glob that reads every rank's files of one table."""
    return f"{run_dir}/{table}/*/*.parquet"


def rank_dir(run_dir: str, table: str, rank: int) -> str:
    """The folder one rank writes one table into (hive layout, zero-padded)."""
    return f"{run_dir}/{table}/rank={rank:05d}"
