"""Import PyTorch Flight Recorder dumps (one file per rank) as a run directory.

A dump is what ``torch.distributed`` writes on a watchdog timeout (pickle, e.g. format 2.9)
or what ``_dump_fr_trace_json`` returns (JSON, 2.10): ``pg_config`` (every process group of
the rank: name, description, ranks), ``pg_status`` (per group index: last enqueued, started
and completed sequence number) and ``entries``, the ring buffer of the rank's most recent
collectives, each with its group, ``collective_seq_id``, ``profiling_name``, state, sizes
and times.

**A dump is data, never code.** Pickles are read with :class:`DataOnlyUnpickler`, whose
``find_class`` refuses every global, so only the pickle opcodes of plain containers and
scalars can build anything; a file that names a global is refused with a one-line error.

Each entry becomes a ``collectives`` row: ``group`` is the group's label (see
:mod:`analyzer.importers.groups`), ``seq`` the ``collective_seq_id`` (``p2p_seq_id`` for
send/recv, whose ``peer`` is parsed from ``nccl:send 9->1`` and mapped from the group's local
numbering to global ranks), ``issue_ns`` the creation time, ``start_ns`` the discovered start
or the issue time, ``end_ns`` the discovered completion, or ``start_ns`` when the entry is
known to have completed without a recorded time (state ``completed``, ``retired``, or a
sequence number at or below the group's ``last_completed_collective``), or null when it had
not completed. Each rank gets one ``heartbeats`` row (its latest time, the last entry's
state); ``run.json`` says ``hung`` when some entry never completed.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

from analyzer.importers.common import (
    ImportResult,
    RefusedTrace,
    TraceError,
    dtype_bytes,
    empty_columns,
    list_files,
    load_all,
    normalize_op,
    numel,
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
    parse_ranks,
    run_json_groups,
)

log = logging.getLogger(__name__)

_P2P_RE = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")
_DONE_STATES = {"completed"}


class DataOnlyUnpickler(pickle.Unpickler):
    """An unpickler that admits no global at all: dicts, lists, tuples, str, bytes, numbers,
    booleans and None build; anything that would import or call is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing persistent id")


def load_dump(path: str) -> dict[str, Any]:
    """One dump (pickle or JSON) as a dict; :class:`TraceError` names the file otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})") from None
    head = data.lstrip()[:1]
    if head == b"{":
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise TraceError(f"{path}: truncated or malformed JSON dump ({e})") from None
    elif data[:1] == b"\x80":
        try:
            obj = DataOnlyUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            if str(e).startswith("refusing"):
                raise RefusedTrace(f"{path}: {e} (a dump holds only plain data)") from None
            raise TraceError(f"{path}: truncated or malformed pickle ({e})") from None
        except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
            raise TraceError(
                f"{path}: truncated or malformed pickle ({type(e).__name__})"
            ) from None
    else:
        raise TraceError(f"{path}: not a Flight Recorder dump (neither pickle nor JSON)")
    entries = obj.get("entries", []) if isinstance(obj, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise TraceError(f"{path}: not a Flight Recorder dump (no list of entries)")
    return obj


def _int(value: Any) -> int | None:
    """Ints as dumps store them (int, numeric string); 0, '', None and junk -> None."""
    try:
        v = int(value)
    except (TypeError, ValueError):
        return None
    return v or None


def _pg_of(entry: Mapping[str, Any]) -> tuple[str, str]:
    pg = entry.get("process_group") or ("", "")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        return str(pg[0]), str(pg[1])
    return str(pg), ""


def collect_groups(dumps: Mapping[int, Mapping[str, Any]]) -> tuple[dict[str, Group], int]:
    """Every process group seen in any dump, and the world size.

    Members come from ``pg_config``; where a dump recorded none (gloo writes ``"[]"``), the
    members are the ranks whose entries use the group, and ``default_pg`` is the whole world.
    """
    desc: dict[str, str] = {}
    ranks: dict[str, set[int]] = {}
    users: dict[str, set[int]] = {}
    for rank, dump in dumps.items():
        config = dump.get("pg_config") or {}
        for key, pg in config.items() if isinstance(config, dict) else ():
            if not isinstance(pg, dict):
                continue
            name = str(pg.get("name", key))
            if name:
                desc.setdefault(name, str(pg.get("desc", "")))
                ranks.setdefault(name, set()).update(parse_ranks(pg.get("ranks")))
        for entry in dump.get("entries", []):
            name, d = _pg_of(entry)
            desc.setdefault(name, d)
            users.setdefault(name, set()).add(rank)
    world = max([r for rs in ranks.values() for r in rs] + list(dumps)) + 1
    groups = {}
    for name, d in desc.items():
        members = ranks.get(name) or users.get(name, set())
        if d == "default_pg" and not ranks.get(name):
            members = set(range(world))
        groups[name] = Group(name, d, tuple(sorted(members)))
    return groups, world


def _completed(entry: Mapping[str, Any], seq: int, status: Mapping[str, Any]) -> bool:
    if str(entry.get("state", "")) in _DONE_STATES or entry.get("retired") is True:
        return True
    last = _int((status.get(str(entry.get("pg_id"))) or {}).get("last_completed_collective"))
    return last is not None and seq <= last


def _peer(entry: Mapping[str, Any], group: Group | None, rank: int) -> int:
    """The global rank at the other end of a send/recv (-1 for collectives).

    ``nccl:send 9->1`` and ``nccl:recv 1<-0`` put this rank on the left and the peer on the
    right, numbered within the group: mapped through the group's ranks when the left number
    is this rank's place in the group, taken as global when it is this rank itself.
    """
    m = _P2P_RE.search(str(entry.get("profiling_name", "")))
    if not m:
        return -1
    me, peer = int(m.group(1)), int(m.group(3))
    ranks = group.ranks if group else ()
    if me != rank and me < len(ranks) and ranks[me] == rank and peer < len(ranks):
        return ranks[peer]
    return peer


def _entry_row(
    entry: Mapping[str, Any], rank: int, group: Group | None, label: str, status: Mapping
) -> dict[str, Any]:
    """One collectives row for one entry (see the module docstring for each column)."""
    name = str(entry.get("profiling_name", ""))
    p2p = bool(entry.get("is_p2p")) or bool(_P2P_RE.search(name))
    seq = int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
    dtypes = entry.get("input_dtypes") or []
    sizes = entry.get("input_sizes") or []
    nbytes = sum(numel(s) * dtype_bytes(d) for s, d in zip(sizes, dtypes, strict=False))
    issue = _int(entry.get("time_created_ns")) or 0
    start = _int(entry.get("time_discovered_started_ns")) or issue
    end = _int(entry.get("time_discovered_completed_ns"))
    done = _completed(entry, seq, status)
    raw = name.split(":", 1)[-1].split(" ")[0] or "unknown"
    return {
        "rank": rank, "step": -1, "microbatch": -1, "op": normalize_op(name) or raw,
        "group": label, "group_size": len(group.ranks) if group else 0, "seq": seq,
        "peer": _peer(entry, group, rank) if p2p else -1, "nbytes": nbytes,
        "dtype": str(dtypes[0]).lower() if dtypes else "", "issue_ns": issue,
        "start_ns": start, "end_ns": (end or start) if done else None,
        "source": "flight_recorder",
    }  # fmt: skip


def _convert_rank(
    run_dir: str, rank: int, dump: Mapping[str, Any], groups: Mapping[str, Group], labels
) -> tuple[int, bool]:
    """Write one rank's collectives and heartbeat; returns (rows, whether something is stuck)."""
    status = dump.get("pg_status") or {}
    entries = sorted(dump.get("entries", []), key=lambda e: int(e.get("record_id") or 0))
    cols = empty_columns("collectives")
    stuck = False
    last_ts, last_state = 0, "idle"
    for entry in entries:
        pg_name, desc = _pg_of(entry)
        row = _entry_row(entry, rank, groups.get(pg_name), labels.get(pg_name, desc), status)
        for k, v in row.items():
            cols[k].append(v)
        stuck |= row["end_ns"] is None
        last_ts = max(last_ts, row["issue_ns"], row["start_ns"], row["end_ns"] or 0)
        last_state = str(entry.get("state", "unknown"))
    n = write_table(run_dir, "collectives", rank, cols)
    beat = {"rank": [rank], "ts_ns": [last_ts], "step": [-1], "state": [last_state]}
    write_table(run_dir, "heartbeats", rank, beat)
    return n, stuck


def _rank_of_dump(path: str, dump: Mapping[str, Any]) -> int:
    rank = dump.get("rank")
    if isinstance(rank, int) and rank >= 0:
        return rank
    rank = rank_from_filename(path)
    if rank is None:
        raise TraceError(f"{path}: cannot tell the rank (no 'rank' key, no number in the name)")
    return rank


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
        rank = _rank_of_dump(path, dump)
        if rank in dumps:
            raise TraceError(f"{path}: a second dump for rank {rank}")
        dumps[rank], origin[rank] = dump, path
    groups, world = collect_groups(dumps)
    mesh = derive_mesh(groups.values(), world) or fallback_mesh(world)
    labels = label_groups(groups.values(), mesh)
    prepare_out_dir(out)
    result = ImportResult(run_dir=out, ranks=sorted(dumps), skipped=skipped)
    stuck = False
    for rank in sorted(dumps):
        try:
            n, s = _convert_rank(out, rank, dumps[rank], groups, labels)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise TraceError(f"{origin[rank]}: malformed entry ({type(e).__name__}: {e})") from None
        result.rows["collectives"] = result.rows.get("collectives", 0) + n
        stuck |= s
    nccl = any(str(d.get("nccl_version") or "").strip() for d in dumps.values())
    device = "cuda" if nccl else "cpu"
    write_topology(out, sorted(dumps), mesh, device=device)
    result.status = "hung" if stuck else "finished"
    versions = {k: next((str(d[k]) for d in dumps.values() if d.get(k)), None)
                for k in ("version", "nccl_version", "comm_lib_version")}  # fmt: skip
    write_run_json(
        out, world_size=world, mesh=mesh, groups=run_json_groups(groups.values(), labels),
        device=device, status=result.status,
        source={"tool": "flight_recorder", "directory": os.path.abspath(directory),
                "files": [os.path.basename(p) for p, _ in loaded], "skipped": skipped,
                "versions": versions, "missing_ranks": sorted(set(range(world)) - set(dumps))},
    )  # fmt: skip
    return result
