"""Who is who in a run: the members of every process group (``group_members``), each rank's
coordinates and host (``rank_coords``), and the filter that keeps a restricted run's complete
channels only (analyzer.db builds its views from these)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from analyzer import parts
from analyzer.runview import RunView
from tracer.rundir import MeshError, coords_of, mesh_groups, mesh_sizes

log = logging.getLogger(__name__)


def int_list(values: Iterable[int]) -> str:
    """``1, 2, 5``: integers for an SQL ``in (...)`` (``null`` when there are none)."""
    return ", ".join(str(int(v)) for v in sorted(values)) or "null"


def complete_channels(members: pa.Table, keep: frozenset[int]) -> list[str]:
    """The filters of a restricted run's collectives that keep only its complete channels,
    one per kind of channel, whose rows they split: a send or recv whose peer is in ``keep``;
    a collective of a group whose members (from ``group_members``) are all in ``keep``, one
    filter per group name; or of a group ``group_members`` does not list (whose members are
    not known: kept). Each is a conjunction of single-column tests, which DuckDB checks
    against the statistics of each row group: parts that hold one kind of channel (synth's
    and ``compact``'s) are skipped whole where their kind is not wanted."""
    df = members.to_pandas()
    df["kept"] = df["rank"].isin(keep)
    inside = df[df.groupby(["group", "gid"], sort=False)["kept"].transform("all")]
    names = sorted({str(g) for g in df["group"]})
    p2p = "op in ('send', 'recv')"
    collective = "not coalesce(op in ('send', 'recv'), false)"
    filters = [f"{p2p} and peer in ({int_list(keep)})"]
    filters += [
        f"\"group\" = '{sql_str(g)}' and {collective} and rank in ({int_list(ranks)})"
        for g, ranks in inside.groupby("group", sort=True)["rank"]
    ]
    listed = ", ".join(f"'{sql_str(n)}'" for n in names) or "null"
    filters.append(f'{collective} and ("group" is null or "group" not in ({listed}))')
    return filters


def sql_str(text: str) -> str:
    """``text`` for a single-quoted SQL string literal (its quotes doubled)."""
    return text.replace("'", "''")


def group_members_table(run: RunView) -> pa.Table:
    """(group, gid, rank, size) for every group used, as explained in the module docstring."""
    meta = run.meta
    listed = [g for g in meta.get("groups") or [] if isinstance(g, dict) and g.get("ranks")]
    if not listed and meta.get("mesh"):
        listed = mesh_groups(meta["mesh"])
    world = int(meta.get("world_size") or 0)
    names = {str(g["name"]) for g in listed}
    seen = run.execute('select distinct "group" from digest_collectives')["group"]
    unlisted = sorted({str(n) for n in seen.dropna()} - names)
    used = pd.DataFrame(columns=["group", "size", "ranks"])
    if unlisted:  # an imported trace: read who used those groups (a scan, on small runs)
        used = run.execute(
            'select "group", max(group_size) as size, list(distinct rank order by rank) as ranks '
            'from collectives where list_contains($names, "group") group by "group"',
            {"names": unlisted},
        )
    rows: list[tuple[str, int, int, int]] = []
    counters: dict[str, int] = {}
    for g in listed:
        name = str(g["name"])
        gid = counters.get(name, 0)
        counters[name] = gid + 1
        ranks = [int(r) for r in g["ranks"]]
        rows += [(name, gid, r, len(ranks)) for r in ranks]
    for name, size, ranks in used.itertuples(index=False):
        if name in names or name is None:
            continue
        size = None if pd.isna(size) else int(size)
        members = list(range(world)) if size and world and size >= world else list(ranks)
        rows += [(name, 0, int(r), len(members)) for r in members]
    return pa.table(
        {
            "group": pa.array([r[0] for r in rows], pa.string()),
            "gid": pa.array([r[1] for r in rows], pa.int32()),
            "rank": pa.array([r[2] for r in rows], pa.int32()),
            "size": pa.array([r[3] for r in rows], pa.int32()),
        }
    )


def mesh_fits(meta: dict[str, Any]) -> bool:
    """Whether run.json has a valid mesh whose sizes multiply to its (non-zero) world size."""
    mesh = meta.get("mesh") or {}
    world = int(meta.get("world_size") or 0)
    try:
        size = math.prod(mesh_sizes(mesh).values())
    except MeshError:
        return False
    return bool(mesh) and world > 0 and size == world


def coords_table(run: RunView) -> pa.Table:
    """(rank, dp, pp, tp, cp, host) for every rank: topology first, else the mesh.

    A run of more than ``FULL_PROBE_MAX_FILES`` ranks whose mesh covers the world takes its
    coordinates from the mesh (SPEC §2 fixes the rank order) and leaves ``host`` null: reading
    12,288 one-row files costs seconds, and a report needs the hosts of the few ranks it names
    only (:func:`hosts`). The rule goes by the world, not by the files, so that a compacted
    run (a few files) reads the same as the run it was made from.
    """
    meta = run.meta
    if run.world_size > parts.FULL_PROBE_MAX_FILES and mesh_fits(meta):
        topo = []
    else:
        topo = run.execute(
            "select rank, any_value(dp), any_value(pp), any_value(tp), any_value(cp), "
            "any_value(host) from topology group by rank"
        ).itertuples(index=False)
    known = {int(r[0]): tuple(r) for r in topo}
    listed = meta.get("coords")  # from the script's own DeviceMesh (tracer.meshinfo)
    if isinstance(listed, list):
        for r, c in enumerate(listed):
            if isinstance(c, list) and len(c) == 4:
                host = known[r][5] if r in known else None
                known[r] = (r, *c, host)
    mesh = meta.get("mesh") or {}
    world = int(meta.get("world_size") or 0)
    ranks = sorted(set(range(world)) | set(known))
    cols: dict[str, list[Any]] = {k: [] for k in ("rank", "dp", "pp", "tp", "cp", "host")}
    for r in ranks:
        c = coords_of(r, mesh) if mesh else {"dp": r, "pp": 0, "tp": 0, "cp": 0}
        row = known.get(r)
        if row is not None and not pd.isna(row[1]):
            c = {"dp": row[1], "pp": row[2], "tp": row[3], "cp": row[4]}
        cols["rank"].append(r)
        for k in ("dp", "pp", "tp", "cp"):
            cols[k].append(int(c[k] or 0))
        host = row[5] if row is not None else None
        cols["host"].append(host if isinstance(host, str) else None)
    types = {"host": pa.string()}
    return pa.table({k: pa.array(v, types.get(k, pa.int32())) for k, v in cols.items()})


def hosts(run: RunView, ranks: Iterable[int]) -> dict[int, str | None]:
    """The host of each of ``ranks``: from ``rank_coords``, else from their topology folders."""
    ranks = sorted({int(r) for r in ranks})
    if not ranks:
        return {}
    got = run.execute(
        "select rank, host from rank_coords where list_contains($ranks, rank)", {"ranks": ranks}
    )
    out = {int(r): h for r, h in zip(got["rank"], got["host"], strict=False)}
    missing = [r for r in ranks if not isinstance(out.get(r), str)]
    files = run.rank_files("topology", missing) if missing else []
    if files:
        try:
            table = pq.ParquetDataset(files, partitioning=None).read(columns=["rank", "host"])
            for r, h in zip(table["rank"].to_pylist(), table["host"].to_pylist(), strict=False):
                out[int(r)] = h
        except (OSError, pa.ArrowException) as e:
            log.warning("hosts not read from topology: %s", str(e).splitlines()[0])
    return {r: (out.get(r) if isinstance(out.get(r), str) else None) for r in ranks}
