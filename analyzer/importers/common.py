"""What the importers share: file discovery, rank numbers, op names, sizes, run.json.

Every importer follows one policy for bad input: a file that cannot be read is skipped with a
warning when other files of the set import (``strict=False``), and is fatal otherwise; the
error is a :class:`TraceError`, one line that names the file.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tracer.opspecs import dtype_bytes, normalize_op, numel  # noqa: F401  (the importers')
from tracer.rundir import base_run_json, coords_of, now_iso, write_json_atomic, write_part
from tracer.schema import TABLES

log = logging.getLogger(__name__)

T = TypeVar("T")


class TraceError(ValueError):
    """An input file that cannot be imported; the message is one line naming the file
    (parsers' multi-line messages are folded onto it)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class RefusedTrace(TraceError):
    """A file that must stop the whole import rather than be skipped (a pickle that names
    code): a set that holds one is not trusted at all."""


@dataclass
class ImportResult:
    """What an import wrote: for the CLI's summary and for tests."""

    run_dir: str
    ranks: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    status: str = "finished"
    # What the summary line should also say (events left out, ranks numbered by name...).
    notes: list[str] = field(default_factory=list)


_RANK_RE = re.compile(r"(\d+)(?:\D*)$")


def rank_from_filename(path: str) -> int | None:
    """The rank a per-rank file names: the last number in its name (``_dump_9``,
    ``rank-1.json.gz``, ``trace_rank_3.pt.trace.json``). ``None`` when there is none."""
    name = os.path.basename(path)
    for suffix in (".gz", ".json", ".pkl", ".pickle", ".trace", ".pt"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    m = _RANK_RE.search(name)
    return int(m.group(1)) if m else None


# A rank-shaped token: ``rank3``, ``rank_3``, ``rank-3``, ``RANK.3``, where ``rank`` starts a
# word (not ``prank3``). Timestamps, pids, job ids and version numbers never are one.
_RANK_TOKEN_RE = re.compile(r"(?<![a-z0-9])rank[_.-]?(\d+)(?![0-9])", re.IGNORECASE)


def rank_token(path: str) -> int | None:
    """The rank a file's name states with a rank-shaped token (``trace_rank_3.json``,
    ``rank-1.pt.trace.json.gz``), else ``None``. Unlike :func:`rank_from_filename` it never
    reads another number (a ``{worker}.{timestamp}`` name, a job id, ``ROCm6_2``) as a rank."""
    found = _RANK_TOKEN_RE.findall(os.path.basename(path))
    return int(found[-1]) if found else None


def list_files(directory: str, accept: Callable[[str], bool]) -> list[str]:
    """The regular files of ``directory`` that ``accept`` admits, sorted by name."""
    if not os.path.isdir(directory):
        raise TraceError(f"{directory}: not a directory")
    names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    paths = [os.path.join(directory, n) for n in names]
    return [p for p in paths if os.path.isfile(p) and accept(p)]


def attempt(load: Callable[[str], T], path: str) -> T | TraceError:
    """``load(path)``, or the :class:`TraceError` it raised (so it can cross processes)."""
    try:
        return load(path)
    except TraceError as e:
        return e


def load_each(
    paths: Sequence[str],
    load: Callable[[str], T],
    *,
    strict: bool,
    skipped: list[str],
    mapper: Callable[..., Iterable[Any]] = map,
) -> Iterator[tuple[str, T]]:
    """Yield ``(path, load(path))`` file by file, so a caller can hold one file at a time.

    ``mapper(fn, paths)`` runs ``fn`` over the paths in order (``map``, or a process pool's
    ``imap`` with a picklable ``load``). A file whose ``load`` raises :class:`TraceError` is
    skipped with a warning (its message is appended to ``skipped``) unless ``strict`` is set
    or it is a :class:`RefusedTrace`; when no file loads, the first error is raised at the end.
    """
    first: TraceError | None = None
    any_loaded = False
    for path, obj in zip(paths, mapper(functools.partial(attempt, load), paths), strict=True):
        if isinstance(obj, TraceError):
            if strict or isinstance(obj, RefusedTrace):
                raise obj
            first = first or obj
            skipped.append(str(obj))
            log.warning("skipping %s", obj)
            continue
        any_loaded = True
        yield path, obj
    if not any_loaded:
        raise first or TraceError("no input files")


def load_all(
    paths: Sequence[str], load: Callable[[str], T], *, strict: bool
) -> tuple[list[tuple[str, T]], list[str]]:
    """:func:`load_each` collected: ``(loaded, skipped)``."""
    skipped: list[str] = []
    loaded = list(load_each(paths, load, strict=strict, skipped=skipped))
    return loaded, skipped


def empty_columns(table: str) -> dict[str, list[Any]]:
    """A dict of empty lists, one per column of a SPEC table."""
    return {f.name: [] for f in TABLES[table]}


def write_table(run_dir: str, table: str, rank: int, columns: Mapping[str, list[Any]]) -> int:
    """Write one part when there are rows; returns the row count."""
    n = len(next(iter(columns.values()), []))
    if n:
        write_part(run_dir, table, rank, columns)
    return n


def write_topology(
    run_dir: str, ranks: Iterable[int], mesh: Mapping[str, int], *, device: str, host: str = ""
) -> None:
    """One topology row per rank, with the mesh coordinates of the SPEC's rank order."""
    for rank in ranks:
        c = coords_of(rank, mesh)
        cols = {
            "rank": [rank], "host": [host], "local_rank": [-1], "pid": [-1],
            "device": [device], "gpu_uuid": [None], "dp": [c["dp"]], "pp": [c["pp"]],
            "tp": [c["tp"]], "cp": [c["cp"]], "clock_offset_ns": [0],
        }  # fmt: skip
        write_part(run_dir, "topology", rank, cols)


def write_run_json(
    run_dir: str,
    *,
    world_size: int,
    mesh: Mapping[str, int],
    groups: Sequence[Mapping[str, Any]],
    device: str,
    status: str,
    source: Mapping[str, Any],
) -> dict[str, Any]:
    """run.json for an imported run; ``source`` (tool, files, skipped) goes under ``import``."""
    meta = base_run_json(
        world_size=world_size, mesh=mesh, groups=groups, device=device, status=status
    )
    meta["ended_at"] = now_iso()
    meta["import"] = dict(source)
    write_json_atomic(os.path.join(run_dir, "run.json"), meta)
    return meta


def prepare_out_dir(out: str) -> bool:
    """Create the run directory; refuse one that already holds a run or other files (no
    silent mixing). Returns whether it was created here (so a failed import may remove it)."""
    if os.path.isdir(out) and os.listdir(out):
        raise TraceError(f"{out}: exists and is not empty (choose a new --out)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise TraceError(f"{out}: exists and is not a directory")
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    return created
