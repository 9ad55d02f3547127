"""Reading Flight Recorder dumps: one file per rank, pickle or JSON, gzip-compressed or not.

**A dump is data, never code.** Pickles are read with :class:`DataOnlyUnpickler`, whose
``find_class`` refuses every global, so only the pickle opcodes of plain containers and
scalars can build anything; a file that names a global is refused with a one-line error.
So is a dump of a format version this reader does not know (2.x is known), and a folder whose
dumps cannot come from one job (two dumps of one rank, one group with two memberships or
descriptions, different format versions or backends).

The process groups of the job come from every dump's ``pg_config`` (:func:`collect_groups`).
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zlib
from collections.abc import Mapping
from typing import Any

from analyzer.importers.common import RefusedTrace, TraceError, rank_from_filename
from analyzer.importers.groups import Group, complete_groups, parse_ranks

_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)\s*$")
KNOWN_MAJOR = 2
MAX_DUMP_BYTES = 1 << 30  # a gzip dump inflated past this is refused


class MixedDumps(TraceError):
    """A folder whose dumps cannot all come from one job."""


class UnknownVersion(RefusedTrace):
    """A dump of a format version this reader does not know: never guessed at, never skipped."""


class DataOnlyUnpickler(pickle.Unpickler):
    """An unpickler that admits no global at all: dicts, lists, tuples, str, bytes, numbers,
    booleans and None build; anything that would import or call is refused."""

    def find_class(self, module: str, name: str) -> Any:
        """Refuse every global: nothing is imported or called."""
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        """Refuse every persistent id."""
        raise pickle.UnpicklingError("refusing persistent id")


def check_version(path: str, dump: Mapping[str, Any]) -> str:
    """The dump's format version; :class:`UnknownVersion` unless it is 2.x."""
    raw = dump.get("version")
    m = _VERSION_RE.match(str(raw)) if raw is not None else None
    if m is None or int(m.group(1)) != KNOWN_MAJOR:
        raise UnknownVersion(
            f"{path}: unknown Flight Recorder format version {raw!r} (this reader knows "
            f"{KNOWN_MAJOR}.x)"
        )
    return f"{int(m.group(1))}.{int(m.group(2))}"


def _gunzip(path: str, data: bytes) -> bytes:
    """A gzip-compressed dump, inflated up to ``MAX_DUMP_BYTES``."""
    z = zlib.decompressobj(wbits=31)
    try:
        out = z.decompress(data, MAX_DUMP_BYTES)
    except zlib.error as e:
        raise TraceError(f"{path}: truncated or malformed gzip ({e})") from None
    if z.unconsumed_tail:
        raise TraceError(f"{path}: inflates past {MAX_DUMP_BYTES >> 20} MiB: not a dump")
    if not z.eof:
        raise TraceError(f"{path}: truncated gzip")
    return out


def load_dump(path: str) -> dict[str, Any]:
    """One dump (pickle or JSON) as a dict; :class:`TraceError` names the file otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})") from None
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(path, data)
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
    entries = obj.get("entries") if isinstance(obj, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise TraceError(f"{path}: not a Flight Recorder dump (no list of entries)")
    check_version(path, obj)
    return obj


def as_int(value: Any) -> int | None:
    """Ints as dumps store them (int, numeric string); 0, '', None and junk -> None."""
    try:
        v = int(value)
    except (TypeError, ValueError):
        return None
    return v or None


def as_signed(value: Any) -> int | None:
    """An int that may be 0 or negative (``pg_status`` numbers; -1: none yet)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def pg_of(entry: Mapping[str, Any]) -> tuple[str, str]:
    """An entry's process group as (name, description); a bare name has description ''."""
    pg = entry.get("process_group") or ("", "")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        return str(pg[0]), str(pg[1])
    return str(pg), ""


def backend_of(entry: Mapping[str, Any]) -> str:
    """The backend an entry's ``profiling_name`` starts with (``nccl``, ``gloo``), lower-cased; ''
    when it names none."""
    name = str(entry.get("profiling_name", ""))
    return name.split(":", 1)[0].lower() if ":" in name else ""


def collect_groups(dumps: Mapping[int, Mapping[str, Any]]) -> tuple[dict[str, Group], int]:
    """Every process group seen in any dump, and the world size.

    Members come from ``pg_config``; where a dump recorded none (gloo writes ``"[]"``), the
    members are the ranks whose entries use the group, completed from the mesh the groups'
    descriptions give for ranks that left no dump (see :func:`groups.complete_groups`), and
    ``default_pg`` is the whole world.
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
            name, d = pg_of(entry)
            desc.setdefault(name, d)
            users.setdefault(name, set()).add(rank)
    world = max([r for rs in ranks.values() for r in rs] + list(dumps)) + 1
    groups = {}
    for name, d in desc.items():
        members = ranks.get(name) or users.get(name, set())
        groups[name] = Group(name, d, tuple(sorted(members)))
    unlisted = {n for n in groups if not ranks.get(n) and groups[n].desc != "default_pg"}
    if unlisted:
        groups, world = complete_groups(groups, unlisted, set(dumps), world)
    for name, g in list(groups.items()):
        if g.desc == "default_pg" and not ranks.get(name):
            groups[name] = Group(name, g.desc, tuple(range(world)))
    return groups, world


def check_one_job(origin: Mapping[int, str], dumps: Mapping[int, Mapping[str, Any]]) -> None:
    """:class:`MixedDumps` when the dumps cannot come from one job (see the module docstring)."""
    seen: dict[str, tuple[int, str]] = {}
    for key in ("version", "nccl_version"):
        for rank, dump in dumps.items():
            value = str(dump.get(key) or "")
            first = seen.setdefault(key, (rank, value))
            if value != first[1]:
                raise MixedDumps(
                    f"{origin[rank]}: {key} {value!r}, but {origin[first[0]]} has "
                    f"{first[1]!r}: dumps from two jobs in one folder?"
                )
    backends: dict[str, int] = {}
    members: dict[str, tuple[int, tuple[int, ...], str]] = {}
    for rank, dump in dumps.items():
        for entry in dump.get("entries", []):
            b = backend_of(entry)
            if b:
                backends.setdefault(b, rank)
        config = dump.get("pg_config") or {}
        for key, pg in config.items() if isinstance(config, dict) else ():
            if not isinstance(pg, dict):
                continue
            name, desc = str(pg.get("name", key)), str(pg.get("desc", ""))
            rs = parse_ranks(pg.get("ranks"))
            if not name or not rs:
                continue
            listed = members.setdefault(name, (rank, rs, desc))
            if (rs, desc) != listed[1:]:
                raise MixedDumps(
                    f"{origin[rank]}: process group {name} ({desc}) has ranks {list(rs)}, but "
                    f"{origin[listed[0]]} says {list(listed[1])} ({listed[2]}): dumps from two "
                    "jobs in one folder?"
                )
    if len(backends) > 1:
        (a, ra), (b, rb) = sorted(backends.items())[:2]
        raise MixedDumps(
            f"{origin[rb]}: {b} entries, but {origin[ra]} has {a} entries: dumps from two jobs "
            "in one folder?"
        )


def rank_of_dump(path: str, dump: Mapping[str, Any]) -> int:
    """The rank of a dump: its ``rank`` key, else the number in its file name. Raises
    :class:`TraceError` when neither says."""
    rank = dump.get("rank")
    if isinstance(rank, int) and rank >= 0:
        return rank
    rank = rank_from_filename(path)
    if rank is None:
        raise TraceError(f"{path}: cannot tell the rank (no 'rank' key, no number in the name)")
    return rank
