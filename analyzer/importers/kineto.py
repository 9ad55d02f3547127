"""Import PyTorch profiler (Kineto) traces, one file per rank, as a run directory.

``import_kineto(DIR, OUT)`` streams every ``*.json`` / ``*.json.gz`` of ``DIR``
(:mod:`analyzer.importers.kineto_parse`), turns each into spans, collectives and heartbeats
(:mod:`analyzer.importers.kineto_rows`), derives the mesh from the process groups' descriptions
(:mod:`analyzer.importers.groups`) and writes the run through :mod:`tracer.rundir`.

The rank of a trace is what the trace states: ``distributedInfo.rank``, else a rank-shaped
token in the file's name (``rank3``, ``rank_3``, ``rank-3``); never another number of the name
(a ``tensorboard_trace_handler`` timestamp, a pid, a job id, a version). A lone trace without
a rank is rank 0 (as HTA takes it); several are numbered in the sorted order of their names,
with the free ranks, and one warning names the mapping. Two traces of one rank, or traces that
state different world sizes, are two jobs' traces: a one-line error. The world is the job's
``distributedInfo.world_size`` even when only some ranks' traces are given (``run.json``'s
``import.ranks`` lists the ranks present); where no trace states it, the ranks present (and
the ranks their process groups name). A world or rank past :data:`tracer.rundir.MAX_WORLD` is
refused in one line. Each rank keeps its own clock (``clock_offset_ns`` 0): Kineto records no
cross-host alignment.

Times are rounded to whole microseconds where Holistic Trace Analysis rounds them (its default,
for traces with sub-microsecond times); ``exact_ns=True`` keeps nanoseconds. Device events
whose launch is not in a trace of several profiler steps are left out, as HTA leaves them out
(:mod:`analyzer.importers.kineto_rows`); the count is in the summary and ``run.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import shutil
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from analyzer.importers.common import (
    ImportResult,
    TraceError,
    list_files,
    load_each,
    prepare_out_dir,
    rank_token,
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
    clock_of,
    collective_rows,
    drop_unlaunched,
    groups_of,
    heartbeat_rows,
    span_rows,
)
from tracer.rundir import MAX_WORLD, MeshError, write_part
from tracer.schema import rank_dir

log = logging.getLogger(__name__)

# Below this much JSON (bytes; a .gz file counts GZIP_RATIO times its size), the files are
# parsed in this process: a worker process takes about a second to start.
PARALLEL_MIN_BYTES = 64 << 20
GZIP_RATIO = 6
STAGING = ".unranked"  # inside OUT: the rows of traces whose rank is decided at the end
PER_FILE_TABLES = ("spans", "heartbeats")


def is_trace_file(path: str) -> bool:
    """Whether ``path`` names a Kineto trace (``.json`` or ``.json.gz``)."""
    return path.endswith((".json", ".json.gz"))


def _int(value: Any) -> int | None:
    """An integer as a trace may write one (``3`` or ``"3"``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _stated_rank(raw: RawTrace) -> tuple[int | None, str]:
    """(rank, where it came from): ``distributedInfo``, a rank token in the name, or none."""
    info = raw.meta.get("distributedInfo")
    rank = _int(info.get("rank")) if isinstance(info, dict) else None
    where = "distributedInfo"
    if rank is None:
        rank, where = rank_token(raw.path), "name"
    if rank is None:
        return None, ""
    if rank >= MAX_WORLD:
        raise TraceError(
            f"{raw.path}: rank {rank} (from its {where}) is not a rank: "
            f"megascope takes at most {MAX_WORLD} ranks"
        )
    return rank, where


def _stated_world(raw: RawTrace) -> int | None:
    info = raw.meta.get("distributedInfo")
    world = _int(info.get("world_size")) if isinstance(info, dict) else None
    return world if world and world > 0 else None


def _comm_only(raw: RawTrace) -> RawTrace:
    """What the collectives still need once spans are written: NCCL kernels, their launches,
    host annotations and steps (a small fraction of a trace)."""
    device = [d for d in raw.device if "nccl" in d[0].lower()]
    launches = {d[5]: raw.launches[d[5]] for d in device if d[5] in raw.launches}
    return dataclasses.replace(raw, device=device, launches=launches)


@dataclass
class Ingested:
    """What one file's ingestion hands back: its rank (None: decided at the end, its rows
    staged), where the rank came from, rows written, communication part."""

    rank: int | None
    rank_from: str
    rows: dict[str, int]
    comm: RawTrace
    had_device: bool


def _staging(out: str, path: str) -> str:
    return os.path.join(out, STAGING, os.path.basename(path))


def ingest(out: str, exact_ns: bool, path: str) -> Ingested:
    """Stream one trace and write its rank's spans and heartbeats (runs in a worker process
    when several files are imported in parallel: each rank writes only its own folders). A
    trace that states no rank writes into a staging folder, moved once ranks are known."""
    raw = parse_trace(path)
    rank, where = _stated_rank(raw)
    drop_unlaunched(raw)
    clock = clock_of(raw, exact_ns)
    target = out if rank is not None else _staging(out, path)
    at = rank if rank is not None else 0
    rows = {
        "spans": write_table(target, "spans", at, span_rows(raw, at, clock)),
        "heartbeats": write_table(target, "heartbeats", at, heartbeat_rows(raw, at, clock)),
    }
    return Ingested(rank, where, rows, _comm_only(raw), bool(raw.device))


def _workers(paths: list[str], workers: int | None) -> int:
    """Parallel file parsing pays off for big sets only (a worker starts in about a second)."""
    if workers is not None:
        return max(1, min(workers, len(paths)))
    total = sum(os.path.getsize(p) * (GZIP_RATIO if p.endswith(".gz") else 1) for p in paths)
    return min(len(paths), os.cpu_count() or 1) if total >= PARALLEL_MIN_BYTES else 1


def import_kineto(
    directory: str,
    out: str,
    *,
    strict: bool = False,
    workers: int | None = None,
    exact_ns: bool = False,
) -> ImportResult:
    """Import the traces of ``directory`` into the new run directory ``out``.

    File by file (in ``workers`` processes for big sets): a trace is streamed, its spans and
    heartbeats are written, and only its communication part is kept until every file is
    read, because the ranks of traces that state none, the collectives' group labels and the
    mesh depend on all files. A failed import leaves no ``out`` behind (when it made it).
    """
    paths = list_files(directory, is_trace_file)
    if not paths:
        raise TraceError(f"{directory}: no Kineto traces (*.json, *.json.gz)")
    created = prepare_out_dir(out)
    result = ImportResult(run_dir=out)
    loaded: list[tuple[str, Ingested]] = []
    n = _workers(paths, workers)
    pool = multiprocessing.get_context("spawn").Pool(n) if n > 1 else None
    try:
        mapper = pool.imap if pool else map
        load = functools.partial(ingest, out, exact_ns)
        owner: dict[int, str] = {}
        # a lone file that fails is the error itself, not a warning before it
        alone = strict or len(paths) == 1
        for path, got in load_each(paths, load, strict=alone, skipped=result.skipped,
                                   mapper=mapper):  # fmt: skip
            if got.rank is not None and got.rank in owner:
                raise _two_jobs(f"{owner[got.rank]} and {path} are both rank {got.rank}")
            if got.rank is not None:
                owner[got.rank] = path
            loaded.append((path, got))
        if pool:
            pool.close()
        traces, rank_from = _assign_ranks(out, loaded, single=len(paths) == 1)
        for _, got in loaded:
            for table, count in got.rows.items():
                result.rows[table] = result.rows.get(table, 0) + count
        had_device = any(got.had_device for _, got in loaded)
        _finish(result, directory, traces, rank_from, exact_ns, had_device)
    except (TraceError, MeshError) as e:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise e if isinstance(e, TraceError) else TraceError(f"{directory}: {e}") from None
    finally:
        if pool:
            pool.terminate()
        shutil.rmtree(os.path.join(out, STAGING), ignore_errors=True)
    return result


def _two_jobs(what: str) -> TraceError:
    return TraceError(
        f"{what}: traces of two jobs (or two runs)? import each job's folder on its own"
    )


def _assign_ranks(out: str, loaded: list[tuple[str, Ingested]], single: bool
                  ) -> tuple[dict[int, RawTrace], dict[str, str]]:  # fmt: skip
    """Every trace's rank (the module docstring); staged rows moved to their rank's folders.
    Returns ``{rank: communication part}`` and ``{file: where its rank came from}``."""
    traces: dict[int, RawTrace] = {}
    rank_from: dict[str, str] = {}
    unranked = sorted((os.path.basename(p), p, got) for p, got in loaded if got.rank is None)
    for path, got in loaded:
        if got.rank is not None:
            traces[got.rank] = got.comm
            rank_from[os.path.basename(path)] = got.rank_from
    free = (r for r in range(MAX_WORLD) if r not in traces)
    mapping = []
    for name, path, got in unranked:
        rank = next(free)
        _move_staged(out, path, rank)
        traces[rank] = got.comm
        rank_from[name] = "the only file" if single else "file name order"
        mapping.append(f"{name}={rank}")
    if unranked and not single:
        log.warning(
            "%d traces state no rank (no distributedInfo, no rankN in the name): numbered by "
            "name: %s", len(unranked), ", ".join(mapping),
        )  # fmt: skip
    return traces, rank_from


def _move_staged(out: str, path: str, rank: int) -> None:
    """Rewrite a staged trace's rows (written as rank 0) as ``rank``'s."""
    staged = _staging(out, path)
    for table in PER_FILE_TABLES:
        folder = rank_dir(staged, table, 0)
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith(".parquet"):
                data = pq.read_table(os.path.join(folder, name))
                ranks = pa.array([rank] * len(data), type=pa.int32())
                data = data.set_column(data.schema.get_field_index("rank"), "rank", ranks)
                write_part(out, table, rank, data)


def _world(traces: dict[int, RawTrace], groups: dict[str, Group]) -> int:
    """The job's world size (the module docstring)."""
    stated: dict[int, str] = {}
    for raw in traces.values():
        world = _stated_world(raw)
        if world is not None:
            stated.setdefault(world, raw.path)
    if len(stated) > 1:
        (a, pa_), (b, pb) = sorted(stated.items())[:2]
        raise _two_jobs(f"{pa_} states world size {a}, {pb} {b}")
    present = max(traces) + 1
    named = max((r + 1 for g in groups.values() for r in g.ranks), default=0)
    if stated:
        world, path = next(iter(stated.items()))
        if present > world:
            raise TraceError(f"{traces[present - 1].path}: rank {present - 1} is outside the "
                             f"world of {world} that {path} states")  # fmt: skip
        world = max(world, named)
    else:
        world = max(present, named)
    if world > MAX_WORLD:
        raise TraceError(
            f"{next(iter(traces.values())).path}: its process groups name rank {world - 1}: "
            f"megascope takes at most {MAX_WORLD} ranks"
        )
    return world


def _finish(result: ImportResult, directory: str, traces: dict[int, RawTrace],
            rank_from: dict[str, str], exact_ns: bool, had_device: bool) -> None:  # fmt: skip
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
        clock = clock_of(raw, exact_ns)
        _write(result, "collectives", rank, collective_rows(raw, rank, clock, labels, groups))
    result.ranks = sorted(traces)
    device = "cuda" if had_device else "cpu"
    host = next((str(t.meta["host_name"]) for t in traces.values() if t.meta.get("host_name")), "")
    write_topology(out, result.ranks, mesh, device=device, host=host)
    source = _source(directory, result.skipped, traces, rank_from, exact_ns)
    dropped, rounded = source["left_out_unlaunched"], source["rounded_to_us"]
    if dropped:
        result.notes.append(
            f"left out {dropped} device events whose launch is not in the trace "
            "(launched before the profiler started), as HTA does"
        )
    if rounded:
        result.notes.append(
            f"times of {len(rounded)} trace(s) rounded to whole microseconds as HTA rounds them "
            "(--exact-ns keeps nanoseconds)"
        )
    write_run_json(
        out, world_size=world, mesh=mesh, groups=run_json_groups(groups.values(), labels),
        device=device, status="finished", source=source,
    )  # fmt: skip


def _write(result: ImportResult, table: str, rank: int, cols: dict[str, list[Any]]) -> None:
    result.rows[table] = result.rows.get(table, 0) + write_table(result.run_dir, table, rank, cols)


def _source(directory: str, skipped: list[str], traces: dict[int, RawTrace],
            rank_from: dict[str, str], exact_ns: bool) -> dict[str, Any]:  # fmt: skip
    steps = sorted({s[0] for t in traces.values() for s in t.steps})
    files = {r: os.path.basename(t.path) for r, t in sorted(traces.items())}
    return {
        "tool": "kineto",
        "directory": os.path.abspath(directory),
        "files": list(files.values()),
        "skipped": skipped,
        "ranks": sorted(traces),
        "rank_from": {files[r]: rank_from.get(files[r], "") for r in files},
        "profiler_steps": steps,
        "events": {str(r): t.events for r, t in sorted(traces.items())},
        "exact_ns": exact_ns,
        "rounded_to_us": [files[r] for r, t in traces.items() if t.sub_us and not exact_ns],
        "left_out_unlaunched": sum(t.no_launch for t in traces.values()),
    }
