"""Writing a run directory (docs/spec.md §2): Parquet parts and run.json, atomically.

Torch-free: the tracer's background writer, the cluster simulator and the importers all write
through these functions, so every producer follows the same rules:

* a part file appears only complete: it is written as ``.part-*.parquet.tmp`` and renamed;
* each rank writes only ``TABLE/rank=RRRRR/``; part numbers grow per (table, rank);
* a compacted run (``megascope compact``) holds ``TABLE/ranks=LLLLL-HHHHH/`` folders instead,
  each with the rows of ranks L..H (both included), sorted by rank and step: see
  :func:`folder_ranks`;
* ``run.json`` is replaced atomically as well, so a reader never sees half a file.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracer.schema import OPTIONAL, SCHEMA_VERSION, TABLES, rank_dir

PARQUET_OPTIONS: dict[str, Any] = {"compression": "zstd", "compression_level": 3}


def now_iso() -> str:
    """UTC time in ISO 8601 with a Z suffix, as run.json stores it."""
    return (
        _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def new_run_id() -> str:
    """A new run id: the UTC time to the second and six random hex digits."""
    return f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def to_table(table: str, columns: Mapping[str, Sequence[Any]] | pa.Table) -> pa.Table:
    """Columns (lists or arrays by name) as an Arrow table with the table's exact schema. A
    column of :data:`~tracer.schema.OPTIONAL` that a writer does not fill (absent, or empty
    beside rows) is written null."""
    schema = TABLES[table]
    optional = OPTIONAL.get(table, ())
    if isinstance(columns, pa.Table):
        for name in optional:
            if name not in columns.column_names:
                columns = columns.append_column(name, pa.nulls(columns.num_rows))
        return columns.select(schema.names).cast(schema)
    n = max((len(v) for v in columns.values()), default=0)
    arrays = [
        pa.nulls(n, f.type)
        if f.name in optional and len(columns.get(f.name, ())) != n
        else pa.array(columns[f.name], type=f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def next_part_index(directory: str) -> int:
    """One past the highest ``part-NNNNNN`` in a folder (0 when there is none)."""
    best = -1
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith("part-") and name.endswith(".parquet"):
            stem = name[len("part-") : -len(".parquet")]
            if stem.isdigit():
                best = max(best, int(stem))
    return best + 1


def _encodings(columns: Sequence[str]) -> dict[str, Any]:
    """Timestamps (``*_ns``) delta-encoded, everything else dictionary-encoded: near-sorted
    int64 times take 2-4 bytes instead of ~5, traced tables a quarter less (measured)."""
    times = [n for n in columns if n.endswith("_ns")]
    return {
        "use_dictionary": [n for n in columns if n not in times],
        "column_encoding": {n: "DELTA_BINARY_PACKED" for n in times},
    }


def parquet_options(columns: Sequence[str]) -> dict[str, Any]:
    """What :func:`write_part` passes to the Parquet writer for a table of these ``columns``
    (compression and encodings), for writers of other layouts (the simulator's rank ranges)."""
    return {**PARQUET_OPTIONS, **_encodings(columns)}


def write_part(
    run_dir: str,
    table: str,
    rank: int,
    columns: Mapping[str, Sequence[Any]] | pa.Table,
    *,
    part: int | None = None,
    prefix: str = "part",
) -> str:
    """Write one Parquet part for ``rank`` and return its path.

    ``part`` defaults to the next free number in the rank's folder. ``prefix`` lets a writer
    that is not the rank itself (the launcher taking stacks of a stuck rank) use names that
    can never collide with the rank's own parts.
    """
    data = to_table(table, columns)
    directory = rank_dir(run_dir, table, rank)
    os.makedirs(directory, exist_ok=True)
    if part is None:
        part = next_part_index(directory)
    final = os.path.join(directory, f"{prefix}-{part:06d}.parquet")
    tmp = os.path.join(directory, f".{prefix}-{part:06d}.parquet.{os.getpid()}.tmp")
    pq.write_table(data, tmp, **parquet_options(data.column_names))
    os.replace(tmp, final)
    return final


def ranks_dir(run_dir: str, table: str, lo: int, hi: int) -> str:
    """The folder of a compacted run that holds the rows of ranks ``lo``..``hi`` (included)."""
    return f"{run_dir}/{table}/ranks={lo:05d}-{hi:05d}"


def folder_ranks(name: str) -> tuple[int, int] | None:
    """The ranks (first, last) whose rows a table's folder holds, from its name: ``rank=N``
    (one rank's parts, as the tracer writes them) or ``ranks=L-H`` (a compacted run); None
    for any other name."""
    key, sep, value = name.partition("=")
    if not sep:
        return None
    if key == "rank" and value.isdigit():
        return int(value), int(value)
    if key == "ranks":
        lo, dash, hi = value.partition("-")
        if dash and lo.isdigit() and hi.isdigit() and int(lo) <= int(hi):
            return int(lo), int(hi)
    return None


# A run over several nodes: each launch's claim and outcome, RUN/.progress/node-KKKKK.json.
NODE_STATUS_ORDER = ("finished", "failed", "hung")  # the worst wins


def combined_status(statuses: Sequence[str | None]) -> str:
    """One status for a run from its nodes' own: ``hung`` if one hung, else ``failed`` if one
    failed (or is still ``running``: its launcher never reported an end), else ``finished``.
    ``None`` (a node whose outcome is not in this directory) is left out."""
    worst = 0
    for status in statuses:
        if status is None:
            continue
        rank = NODE_STATUS_ORDER.index(status) if status in NODE_STATUS_ORDER else 1
        worst = max(worst, rank)
    return NODE_STATUS_ORDER[worst]


WATCHING = ".watching"  # `megascope watch`'s marker: its pid and heartbeat (docs/spec.md §1)
WATCH_BEAT_S = 1.0  # a watch touches its marker this often (analyzer/commands/watch.py)
WATCHED_S = 10.0  # a marker younger than this is fresh: a watch follows the run


def mark_watched(run_dir: str, pid: int | None = None) -> None:
    """Say that a watch follows this run live (``megascope watch``): while the marker is fresh
    its tracers keep their configured flush interval and write each step as it ends, at most
    every :data:`tracer.budget.WATCHED_FLUSH_S` (tracer/budget.py). The marker holds the
    watch's host and pid; its modification time is the heartbeat. A run directory that is not
    there yet, or read-only, is left alone."""
    path = os.path.join(run_dir, WATCHING)
    try:
        if not os.path.isfile(path):
            if not os.path.isdir(run_dir):
                return
            body = {"host": socket.gethostname(), "pid": os.getpid() if pid is None else pid}
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(body, f)
            os.replace(tmp, path)
        else:
            os.utime(path)
    except OSError:
        pass


def unmark_watched(run_dir: str) -> None:
    """A watch that stops: remove its marker, if it is this process's (another watch that
    wrote it since keeps it; one that finds it gone writes it again at its next beat)."""
    path = os.path.join(run_dir, WATCHING)
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        if body.get("pid") == os.getpid() and body.get("host") == socket.gethostname():
            os.remove(path)
    except (OSError, ValueError, AttributeError):
        pass


def marker_fresh(mtime: float | None, now: float, stale_s: float = WATCHED_S) -> bool:
    """Whether a watch marker touched at ``mtime`` (None: there is none) is fresh at ``now``:
    touched less than ``stale_s`` ago (a clock a little behind the writer's counts as now)."""
    return mtime is not None and now - mtime < stale_s


def watched(run_dir: str) -> bool:
    """Whether a watch follows this run now: its marker is fresh (one ``stat``)."""
    try:
        mtime: float | None = os.stat(os.path.join(run_dir, WATCHING)).st_mtime
    except OSError:
        mtime = None
    return marker_fresh(mtime, time.time())


def write_json_atomic(path: str, obj: Mapping[str, Any]) -> None:
    """Write ``obj`` as indented JSON to ``path`` through a temporary file and a rename, so that a
    reader never sees half of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def update_run_json(run_dir: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Read run.json, apply ``change`` to it and write it back, holding a lock on the run's
    ``.run.json.lock``, so that ranks that update it at the same time (their counts of what was
    dropped, rank 0's status) lose none of each other's changes."""
    import fcntl

    with open(os.path.join(run_dir, ".run.json.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            meta = read_run_json(run_dir)
            change(meta)
            write_json_atomic(os.path.join(run_dir, "run.json"), meta)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# The run's status where run.json cannot be written any more (its disk full): a record reserved
# at the start, overwritten in place (docs/spec.md §1).

RESERVED_BYTES = 16384
RESERVED = ".storage.json"


def reserve_status(run_dir: str) -> None:
    """Write ``RUN/.storage.json`` as blanks at the start of a run (the launcher's, or rank 0's
    tracer for a script's own run): its blocks are then the writer's, and :func:`write_reserved` overwrites them in place even when the disk is
    full later (a read-only disk takes nothing). A failure here is left unsaid."""
    try:
        with open(os.path.join(run_dir, RESERVED), "wb") as f:
            f.write(b" " * RESERVED_BYTES)
    except OSError:
        pass


def write_reserved(run_dir: str, record: dict[str, Any]) -> bool:
    """Overwrite the reserved record with ``record`` as JSON (no new block needed: it fits in
    what :func:`reserve_status` wrote; lists are cut short to fit). Returns whether it was
    written."""
    record = dict(record)
    data = json.dumps(record).encode()
    while len(data) > RESERVED_BYTES:
        lists = [k for k, v in record.items() if isinstance(v, list) and v]
        if not lists:
            return False
        for k in lists:
            record[k] = record[k][: len(record[k]) // 2]
        data = json.dumps(record).encode()
    try:
        fd = os.open(os.path.join(run_dir, RESERVED), os.O_WRONLY)
    except OSError:
        return False
    try:
        os.pwrite(fd, data.ljust(RESERVED_BYTES), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read_reserved(run_dir: str) -> dict[str, Any]:
    """The reserved record (``{}`` when none was written or it is unreadable)."""
    try:
        with open(os.path.join(run_dir, RESERVED), encoding="utf-8") as f:
            text = f.read().strip()
        obj = json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


RANK_NOTES = ".ranks"  # a rank's run.json entries where it has no run.json (a node's own disk)


def record_for_rank(run_dir: str, rank: int, key: str, value: Any) -> str:
    """run.json's ``key`` of ``rank`` (``dropped``, ``tracer_cpu``: by rank), under its lock.
    Where this node's copy of the run has no run.json (a node other than node 0, writing to its
    own disk), the entry goes to ``RUN/.ranks/rank-NNNNN.json`` instead, which ``megascope
    gather`` folds into the run.json it writes (:func:`fold_rank_notes`). Returns the file
    written."""
    if os.path.exists(os.path.join(run_dir, "run.json")):
        update_run_json(run_dir, lambda meta: meta.setdefault(key, {}).update({str(rank): value}))
        return os.path.join(run_dir, "run.json")
    folder = os.path.join(run_dir, RANK_NOTES)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{int(rank):05d}.json")
    try:
        with open(path, encoding="utf-8") as f:
            notes = json.load(f)
    except (FileNotFoundError, ValueError):
        notes = {}
    notes[key] = value
    write_json_atomic(path, notes)
    return path


def fold_rank_notes(run_dir: str, meta: dict[str, Any]) -> int:
    """Fold ``RUN/.ranks/rank-NNNNN.json`` (:func:`record_for_rank`) into ``meta``'s entries by
    rank, an entry in run.json winning; returns how many files were folded."""
    folder = os.path.join(run_dir, RANK_NOTES)
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return 0
    folded = 0
    for name in names:
        if not (name.startswith("rank-") and name.endswith(".json") and name[5:-5].isdigit()):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                notes = json.load(f)
        except (OSError, ValueError):
            continue
        rank = str(int(name[5:-5]))
        for key, value in notes.items() if isinstance(notes, dict) else ():
            entries = meta.setdefault(key, {})
            if isinstance(entries, dict):
                entries.setdefault(rank, value)
        folded += 1
    return folded


def read_run_json(run_dir: str) -> dict[str, Any]:
    """run.json as a dict. Raises ValueError with a one-line reason when it is unusable."""
    path = os.path.join(run_dir, "run.json")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{run_dir}: no run.json (not a megascope run directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


def base_run_json(
    *,
    run_id: str | None = None,
    world_size: int,
    mesh: Mapping[str, int],
    groups: Sequence[Mapping[str, Any]] = (),
    device: str = "cpu",
    model: Mapping[str, Any] | None = None,
    tracer: Mapping[str, Any] | None = None,
    injections: Sequence[str] = (),
    versions: Mapping[str, Any] | None = None,
    status: str = "running",
) -> dict[str, Any]:
    """A run.json with every key of the SPEC, ready to be updated and written."""
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id or new_run_id(),
        "started_at": now_iso(),
        "ended_at": None,
        "status": status,
        "world_size": int(world_size),
        "mesh": {k: int(mesh.get(k, 1)) for k in AXES},
        "groups": [dict(g) for g in groups],
        "model": dict(model or {}),
        "device": device,
        "versions": dict(versions or {}),
        "tracer": dict(tracer or {}),
        "injections": list(injections),
        "summary": {},
        "host": socket.gethostname(),
    }


# The mesh's axes as run.json, the tables and the reports name them (SPEC §2), and the same
# axes from the innermost out: the rank order, tensor fastest, pipeline outermost.
AXES = ("dp", "pp", "tp", "cp")
RANK_ORDER = ("tp", "cp", "dp", "pp")


def coords_of(rank: int, mesh: Mapping[str, int]) -> dict[str, int]:
    """(dp, pp, tp, cp) of a rank: pipeline outermost, tensor innermost (SPEC §2)."""
    tp_size, cp_size, dp_size = (int(mesh.get(k, 1)) for k in ("tp", "cp", "dp"))
    tp = rank % tp_size
    rest = rank // tp_size
    cp = rest % cp_size
    rest //= cp_size
    dp = rest % dp_size
    pp = rest // dp_size
    return {"dp": dp, "pp": pp, "tp": tp, "cp": cp}


def rank_of(coords: Mapping[str, int], mesh: Mapping[str, int]) -> int:
    """Inverse of :func:`coords_of`."""
    dp_size, cp_size, tp_size = (int(mesh.get(k, 1)) for k in ("dp", "cp", "tp"))
    return ((coords["pp"] * dp_size + coords["dp"]) * cp_size + coords["cp"]) * tp_size + coords[
        "tp"
    ]


# More ranks than any job has had (the largest run a few hundred thousand GPUs): a mesh or a
# world past this comes from a bad number (a job id or a timestamp read as a rank), and is
# refused in one line instead of being built.
MAX_WORLD = 1 << 20


class MeshError(ValueError):
    """A mesh that cannot be a job's: an axis that is not a positive integer, or more than
    :data:`MAX_WORLD` ranks. The message is one line."""


def mesh_sizes(mesh: Mapping[str, Any]) -> dict[str, int]:
    """The (dp, pp, tp, cp) sizes of a mesh (a missing or null axis is 1), checked: each a
    positive integer, their product at most :data:`MAX_WORLD`; else :class:`MeshError`."""
    sizes: dict[str, int] = {}
    for k in AXES:
        v = mesh.get(k, 1)
        v = 1 if v is None else v
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MeshError(f"mesh {dict(mesh)!r}: {k}={v!r} is not a positive integer")
        sizes[k] = v
    world = sizes["dp"] * sizes["pp"] * sizes["tp"] * sizes["cp"]
    if world > MAX_WORLD:
        raise MeshError(
            f"mesh {dict(mesh)!r}: {world} ranks, more than the {MAX_WORLD} megascope takes"
        )
    return sizes


def mesh_groups(mesh: Mapping[str, int]) -> list[dict[str, Any]]:
    """Every dp/pp/tp/cp group of a mesh as ``{name, ranks}``, in the SPEC's rank order.

    Groups of size one are left out: they carry no communication. Each group is built
    directly from the strides of the rank order, so the cost is one pass over the world per
    axis; a mesh :func:`mesh_sizes` refuses raises :class:`MeshError` before anything is built.
    """
    sizes = mesh_sizes(mesh)
    world = sizes["dp"] * sizes["pp"] * sizes["tp"] * sizes["cp"]
    # Rank order (SPEC §2): pp outermost, then dp, cp, tp innermost; the stride of an axis is
    # the product of the sizes inside it.
    stride = {"tp": 1, "cp": sizes["tp"]}
    stride["dp"] = stride["cp"] * sizes["cp"]
    stride["pp"] = stride["dp"] * sizes["dp"]
    out: list[dict[str, Any]] = []
    for axis in RANK_ORDER:
        size, step = sizes[axis], stride[axis]
        if size == 1:
            continue
        block = step * size  # ranks that differ in this axis and those inside it
        for base in range(0, world, block):
            for offset in range(step):
                first = base + offset
                out.append({"name": axis, "ranks": list(range(first, first + block, step))})
    return out
