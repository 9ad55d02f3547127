"""Import PyTorch profiler (Kineto) traces, one file per rank, as a run directory.

``import_kineto(DIR, OUT)`` streams every ``*.json`` / ``*.json.gz`` of ``DIR``
(:mod:`analyzer.importers.kineto_parse`), turns each into spans, collectives and heartbeats
(:mod:`analyzer.importers.kineto_rows`), derives the mesh from the process groups' descriptions
(:mod:`analyzer.importers.groups`) and writes the run through :mod:`tracer.rundir`.

The rank of a trace is ``distributedInfo.rank``, or the last number in the file's name. Each
rank keeps its own clock (``clock_offset_ns`` 0): Kineto records no cross-host alignment.
``world_size`` is the job's (``distributedInfo.world_size``) even when only some ranks' traces
are given; ``run.json``'s ``import.ranks`` lists the ranks present.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import shutil
from dataclasses import dataclass
from typing import Any

from analyzer.importers.common import (
    ImportResult,
    TraceError,
    list_files,
    load_each,
    prepare_out_dir,
    rank_from_filename,
    write_run_json,
    write_table,
    write_topology,
)
from analyzer.importers.groups import (
    Group,
    derive_mesh,
    fallback_mesh,
    label_groups,
    run_json_groups,
)
from analyzer.importers.kineto_parse import RawTrace, parse_trace
from analyzer.importers.kineto_rows import (
    Clock,
    collective_rows,
    groups_of,
    heartbeat_rows,
    span_rows,
)

log = logging.getLogger(__name__)

# Below this much JSON (bytes; a .gz file counts GZIP_RATIO times its size), the files are
# parsed in this process: a worker process takes about a second to start.
PARALLEL_MIN_BYTES = 64 << 20
GZIP_RATIO = 6


def is_trace_file(path: str) -> bool:
    return path.endswith((".json", ".json.gz"))


def _rank_of(raw: RawTrace) -> int:
    rank = (raw.meta.get("distributedInfo") or {}).get("rank")
    if isinstance(rank, int) and rank >= 0:
        return rank
    rank = rank_from_filename(raw.path)
    if rank is None:
        raise TraceError(
            f"{raw.path}: cannot tell the rank (no distributedInfo, no number in the name)"
        )
    return rank


def _world(traces: dict[int, RawTrace], groups: dict[str, Group]) -> int:
    """The job's world size: the largest of what the traces say and the ranks they name."""
    sizes = [(t.meta.get("distributedInfo") or {}).get("world_size") for t in traces.values()]
    seen = [r + 1 for g in groups.values() for r in g.ranks] + [r + 1 for r in traces]
    return max([s for s in sizes if isinstance(s, int)] + seen)


def _comm_only(raw: RawTrace) -> RawTrace:
    """What the collectives still need once spans are written: NCCL kernels, their launches,
    host annotations and steps (a small fraction of a trace)."""
    device = [d for d in raw.device if "nccl" in d[0].lower()]
    launches = {d[5]: raw.launches[d[5]] for d in device if d[5] in raw.launches}
    return RawTrace(path=raw.path, meta=raw.meta, device=device, launches=launches,
                    steps=raw.steps, comm=raw.comm, params=raw.params, c10d=raw.c10d,
                    pid=raw.pid, events=raw.events)  # fmt: skip


@dataclass
class Ingested:
    """What one file's ingestion hands back: its rank, rows written, communication part."""

    rank: int
    rows: dict[str, int]
    comm: RawTrace
    had_device: bool


def ingest(out: str, path: str) -> Ingested:
    """Stream one trace and write its rank's spans and heartbeats (runs in a worker process
    when several files are imported in parallel: each rank writes only its own folders)."""
    raw = parse_trace(path)
    rank = _rank_of(raw)
    clock = Clock(raw.meta.get("baseTimeNanoseconds"))
    rows = {
        "spans": write_table(out, "spans", rank, span_rows(raw, rank, clock)),
        "heartbeats": write_table(out, "heartbeats", rank, heartbeat_rows(raw, rank, clock)),
    }
    return Ingested(rank, rows, _comm_only(raw), bool(raw.device))


def _workers(paths: list[str], workers: int | None) -> int:
    """Parallel file parsing pays off for big sets only (a worker starts in about a second)."""
    if workers is not None:
        return max(1, min(workers, len(paths)))
    total = sum(os.path.getsize(p) * (GZIP_RATIO if p.endswith(".gz") else 1) for p in paths)
    return min(len(paths), os.cpu_count() or 1) if total >= PARALLEL_MIN_BYTES else 1


def import_kineto(
    directory: str, out: str, *, strict: bool = False, workers: int | None = None
) -> ImportResult:
    """Import the traces of ``directory`` into the new run directory ``out``.

    File by file (in ``workers`` processes for big sets): a trace is streamed, its spans and
    heartbeats are written, and only its communication part is kept until every file is
    read, because the collectives' group labels and the mesh depend on all ranks' groups.
    """
    paths = list_files(directory, is_trace_file)
    if not paths:
        raise TraceError(f"{directory}: no Kineto traces (*.json, *.json.gz)")
    created = prepare_out_dir(out)
    result = ImportResult(run_dir=out)
    traces: dict[int, RawTrace] = {}
    files: list[str] = []
    had_device = False
    n = _workers(paths, workers)
    pool = multiprocessing.get_context("spawn").Pool(n) if n > 1 else None
    try:
        mapper = pool.imap if pool else map
        load = functools.partial(ingest, out)
        for path, got in load_each(paths, load, strict=strict, skipped=result.skipped,
                                   mapper=mapper):  # fmt: skip
            if got.rank in traces:
                raise TraceError(f"{path}: a second trace for rank {got.rank}")
            for table, count in got.rows.items():
                result.rows[table] = result.rows.get(table, 0) + count
            had_device |= got.had_device
            traces[got.rank] = got.comm
            files.append(os.path.basename(path))
    except TraceError:
        if created and not traces:
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        if pool:
            pool.terminate()
    _finish(result, directory, files, traces, had_device)
    return result


def _finish(result: ImportResult, directory: str, files: list[str],
            traces: dict[int, RawTrace], had_device: bool) -> None:  # fmt: skip
    """Groups, mesh and labels from all ranks; then collectives, topology and run.json."""
    out = result.run_dir
    groups: dict[str, Group] = {}
    for raw in traces.values():
        for name, g in groups_of(raw).items():
            if name not in groups or (g.ranks and not groups[name].ranks):
                groups[name] = g
    world = _world(traces, groups)
    mesh = derive_mesh(groups.values(), world) or fallback_mesh(world)
    labels = label_groups(groups.values(), mesh)
    for rank, raw in sorted(traces.items()):
        clock = Clock(raw.meta.get("baseTimeNanoseconds"))
        _write(result, "collectives", rank, collective_rows(raw, rank, clock, labels, groups))
    result.ranks = sorted(traces)
    device = "cuda" if had_device else "cpu"
    host = next((str(t.meta["host_name"]) for t in traces.values() if t.meta.get("host_name")), "")
    write_topology(out, result.ranks, mesh, device=device, host=host)
    write_run_json(
        out, world_size=world, mesh=mesh, groups=run_json_groups(groups.values(), labels),
        device=device, status="finished", source=_source(directory, files, result.skipped, traces),
    )  # fmt: skip


def _write(result: ImportResult, table: str, rank: int, cols: dict[str, list[Any]]) -> None:
    result.rows[table] = result.rows.get(table, 0) + write_table(result.run_dir, table, rank, cols)


def _source(
    directory: str, files: list[str], skipped: list[str], traces: dict[int, RawTrace]
) -> dict[str, Any]:
    steps = sorted({s[0] for t in traces.values() for s in t.steps})
    return {
        "tool": "kineto",
        "directory": os.path.abspath(directory),
        "files": files,
        "skipped": skipped,
        "ranks": sorted(traces),
        "profiler_steps": steps,
        "events": {str(r): t.events for r, t in sorted(traces.items())},
    }
