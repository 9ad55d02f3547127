"""Import PyTorch Flight Recorder dumps (one file per rank) as a run directory.

A dump (gzip-compressed or not) is what ``torch.distributed`` writes on a watchdog timeout
(pickle, e.g. format 2.9) or what ``_dump_fr_trace_json`` / ``_dump_fr_trace`` return (JSON or pickle, 2.10), from NCCL
or gloo: ``pg_config`` (every process group of the rank: name, description, ranks; nearly
empty on gloo), ``pg_status`` (per group index ``pg_id``: last enqueued, started and completed
work) and ``entries``, the ring buffer of the rank's most recent operations (on a timeout often
only the ones still active), each with its group, ``collective_seq_id``, ``p2p_seq_id``,
``op_id``, ``profiling_name``, state, sizes and times.

Reading (:mod:`analyzer.importers.fr_read`: data only, never code; one job per folder), then
matching the entries across ranks (:mod:`analyzer.importers.fr_match`: completion, coalesced
batches, send/recv numbering, ``pg_status``), then the rows written here.

Each entry becomes a ``collectives`` row: ``group`` is the group's label (see
:mod:`analyzer.importers.groups`), ``seq`` the ``collective_seq_id`` (``p2p_seq_id`` for
send/recv, whose ``peer`` is parsed from ``nccl:send 9->1`` and mapped from the group's local
numbering to global ranks), ``issue_ns`` the creation time, ``start_ns`` the discovered start
or the issue time, ``end_ns`` the discovered completion, or ``start_ns`` when the entry is
known to have completed without a recorded time, or null when it had not completed.

A collective a rank finished before its buffer's first entry gets one row at its last
completed seq (``source`` ``flight_recorder_status``, op ``unknown`` unless another rank
recorded that seq).

Each rank gets one ``heartbeats`` row (its latest time, the last entry's state); ``run.json``
says ``hung`` when some entry never completed or some rank of the job left no dump. Ranks in
the groups with no dump are listed in ``run.json`` (``import.missing_ranks``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from analyzer.importers.common import (
    ImportResult,
    TraceError,
    dtype_bytes,
    empty_columns,
    list_files,
    load_all,
    normalize_op,
    numel,
    prepare_out_dir,
    write_run_json,
    write_table,
    write_topology,
)
from analyzer.importers.fr_match import (
    Entry,
    RankEntries,
    prepare,
    renumber_p2p,
    retire_lag,
    status_markers,
)
from analyzer.importers.fr_read import (  # noqa: F401  (re-exported: the reading API)
    DataOnlyUnpickler,
    MixedDumps,
    UnknownVersion,
    as_int,
    backend_of,
    check_one_job,
    check_version,
    collect_groups,
    load_dump,
    rank_of_dump,
)
from analyzer.importers.groups import (
    Group,
    derive_mesh,
    fallback_mesh,
    label_groups,
    run_json_groups,
)

log = logging.getLogger(__name__)


def _row(e: Entry, rank: int, group: Group | None, label: str, peer: int) -> dict[str, Any]:
    """One collectives row for one entry (see the module docstring for each column)."""
    entry = e.raw
    dtypes = entry.get("input_dtypes") or []
    sizes = entry.get("input_sizes") or []
    nbytes = sum(numel(s) * dtype_bytes(d) for s, d in zip(sizes, dtypes, strict=False))
    issue = as_int(entry.get("time_created_ns")) or 0
    start = as_int(entry.get("time_discovered_started_ns")) or issue
    end = as_int(entry.get("time_discovered_completed_ns"))
    duration = entry.get("duration_ms")  # the device's own time (NCCL's timing on)
    if end and isinstance(duration, (int, float)) and duration >= 0:
        start = max(issue, end - round(float(duration) * 1e6))
    raw = e.name.split(":", 1)[-1].split(" ")[0] or "unknown"
    return {
        "rank": rank, "step": -1, "microbatch": -1, "op": normalize_op(e.name) or raw,
        "group": label, "group_size": len(group.ranks) if group else 0, "seq": e.seq,
        "peer": peer, "nbytes": nbytes, "dtype": str(dtypes[0]).lower() if dtypes else "",
        "issue_ns": issue, "start_ns": start, "end_ns": (end or start) if e.done else None,
        "source": "flight_recorder",
    }  # fmt: skip


def _convert_rank(
    run_dir: str,
    r: RankEntries,
    groups: Mapping[str, Group],
    labels: Mapping[str, str],
    markers: list[tuple[str, int]],
    ops_at: Mapping[tuple[str, int], str],
    t_first: int,
) -> tuple[int, bool]:
    """Write one rank's collectives and heartbeat; returns (rows, whether something is stuck)."""
    cols = empty_columns("collectives")
    stuck = False
    last_ts, last_state = 0, "idle"
    for e in r.entries:
        group = groups.get(e.pg_name)
        row = _row(e, r.rank, group, labels.get(e.pg_name, e.desc), r.peers[id(e)])
        for k, v in row.items():
            cols[k].append(v)
        stuck |= row["end_ns"] is None
        last_ts = max(last_ts, row["issue_ns"], row["start_ns"], row["end_ns"] or 0)
        last_state = str(e.raw.get("state", "unknown"))
    times = [t for t in cols["issue_ns"] if t]
    t0 = min(times) if times else t_first
    for name, seq in markers:
        group = groups.get(name)
        row = {
            "rank": r.rank, "step": -1, "microbatch": -1, "op": ops_at.get((name, seq), "unknown"),
            "group": labels.get(name, name), "group_size": len(group.ranks) if group else 0,
            "seq": seq, "peer": -1, "nbytes": 0, "dtype": "", "issue_ns": t0, "start_ns": t0,
            "end_ns": t0, "source": "flight_recorder_status",
        }  # fmt: skip
        for k, v in row.items():
            cols[k].append(v)
    n = write_table(run_dir, "collectives", r.rank, cols)
    beat: dict[str, list[Any]] = {
        "rank": [r.rank],
        "ts_ns": [last_ts or t0],
        "step": [-1],
        "state": [last_state],
    }
    write_table(run_dir, "heartbeats", r.rank, beat)
    return n, stuck


def import_flight_recorder(directory: str, out: str, *, strict: bool = False) -> ImportResult:
    """Import every dump in ``directory`` (one per rank) into the run directory ``out``."""
    paths = list_files(directory, lambda p: not p.endswith((".log", ".txt", ".md")))
    if not paths:
        raise TraceError(f"{directory}: no Flight Recorder dumps")
    # A refused pickle (RefusedTrace) is never skipped: a set that holds code is not imported.
    loaded, skipped = load_all(paths, load_dump, strict=strict)
    dumps: dict[int, dict[str, Any]] = {}
    origin: dict[int, str] = {}
    for path, dump in loaded:
        rank = rank_of_dump(path, dump)
        if rank in dumps:
            raise MixedDumps(
                f"{path}: a second dump for rank {rank} (the first is {origin[rank]}): dumps "
                "from two jobs in one folder?"
            )
        dumps[rank], origin[rank] = dump, path
    check_one_job(origin, dumps)
    groups, world = collect_groups(dumps)
    mesh = derive_mesh(groups.values(), world) or fallback_mesh(world)
    labels = label_groups(groups.values(), mesh)
    try:
        backend = next((b for d in dumps.values() for e in d.get("entries", [])
                        if (b := backend_of(e))), "")  # fmt: skip
        ranks, kinds = prepare(dumps, groups, backend)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TraceError(f"{directory}: malformed entry ({type(e).__name__}: {e})") from None
    if backend == "gloo":
        retire_lag(ranks, groups)
    renumbered = renumber_p2p(ranks)
    markers = status_markers(ranks, groups, kinds)
    ops_at: dict[tuple[str, int], str] = {}
    for r in ranks.values():
        for entry in r.entries:
            if not entry.p2p:
                ops_at.setdefault((entry.pg_name, entry.seq), normalize_op(entry.name) or "unknown")
    times = [as_int(e.raw.get("time_created_ns")) for r in ranks.values() for e in r.entries]
    t_first = min((t for t in times if t), default=0)
    prepare_out_dir(out)
    result = ImportResult(run_dir=out, ranks=sorted(dumps), skipped=skipped)
    stuck = False
    for rank in sorted(dumps):
        n, s = _convert_rank(
            out, ranks[rank], groups, labels, markers.get(rank, []), ops_at, t_first
        )
        result.rows["collectives"] = result.rows.get("collectives", 0) + n
        stuck |= s
    nccl = any(str(d.get("nccl_version") or "").strip() for d in dumps.values())
    device = "cuda" if nccl else "cpu"
    write_topology(out, sorted(dumps), mesh, device=device)
    members = {r for g in groups.values() for r in g.ranks} | set(range(world))
    missing = sorted(members - set(dumps))
    result.status = "hung" if stuck or missing else "finished"
    versions = {k: next((str(d[k]) for d in dumps.values() if d.get(k)), None)
                for k in ("version", "nccl_version", "comm_lib_version")}  # fmt: skip
    write_run_json(
        out, world_size=world, mesh=mesh, groups=run_json_groups(groups.values(), labels),
        device=device, status=result.status,
        source={"tool": "flight_recorder", "directory": os.path.abspath(directory),
                "files": [os.path.basename(p) for p, _ in loaded], "skipped": skipped,
                "versions": versions, "missing_ranks": missing,
                "p2p_renumbered": renumbered,
                "status_rows": sum(len(v) for v in markers.values())},
    )  # fmt: skip
    return result
