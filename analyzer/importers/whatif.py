"""``megascope import whatif TRACE.parquet --meta META.yaml --out RUN``: the what-if study's schema.

The trace schema of ByteDance Seed's straggler study (OSDI 2025, "Understanding Stragglers in
Large Model Training Using What-if Analysis"): one row per recorded operation with ``dp_rank``,
``stage``, ``rank`` (global), ``step``, ``optype``, ``start_ts`` and ``duration`` (seconds,
relative to the step), ``seq_id`` (order of the ops of one type in a step on a worker), ``mc`` /
``gmc`` (model chunk, local and global: interleaved pipelines) and ``mb_id`` (microbatch, compute
only); the meta file gives ``dp_size``, ``pp_size``, ``tp_size``, ``dsp_size``, ``vpp_size`` and
``world_size``.

The import keeps the trace's global ranks and coordinates (``dp = dp_rank``, ``pp = stage``,
tensor and data-sequence coordinates from the rank; ``dsp`` is the mesh's ``cp`` axis) and writes:

* spans: ``forward`` / ``backward`` (``forward-compute`` / ``backward-compute``, microbatch
  ``mb_id``), ``optimizer``, ``gc`` (kind host), and one ``step`` span per rank and step;
* collectives: pipeline ``send`` / ``recv`` (the k-th live forward send of a stage pairs with the
  k-th live forward receive of the next stage; backward the other way; with ``vpp_size`` > 1 the
  last stage sends on to the first; a transfer the model does not have, such as a forward send
  of the model's last chunk, found from the ``gmc`` of the compute it belongs to, is left out and
  counted), ``grads-reduce-scatter`` / ``params-all-gather`` / ``separate-grads-all-reduce``
  over the data-parallel group (dp x dsp), ``layernorm-grads-all-reduce`` over tensor parallel,
  ``embedding-grads-all-reduce`` between the first and last stage, and
  ``optimizer-clip-main-grad`` over the whole world.

Steps are laid one after the other on one clock (each trace step starts at its own zero). A
trace that records one worker per tensor-parallel group (global ranks 0, 4, 8, ... at tp4)
leaves the other ranks without rows: run.json ``import.recorded_ranks`` names the recorded ones,
and the run is ``finished`` (an unrecorded rank is not a crashed one).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from analyzer.importers.common import ImportResult, TraceError, prepare_out_dir, write_run_json
from tracer.rundir import MAX_WORLD, coords_of, rank_of, write_part

REQUIRED = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id")
OPTIONAL_INT = ("mc", "mb_id", "gmc")
SIZES = ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "world_size")
BASE_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z: the first step's start
STEP_GAP_S = 1e-3  # between one step's last op and the next step's first

SPAN_OF = {  # optype -> (span name, kind)
    "forward-compute": ("forward", "compute"),
    "backward-compute": ("backward", "compute"),
    "optimizer": ("optimizer", "compute"),
    "gc": ("gc", "host"),
}
COLL_OF = {  # optype -> (op, group)
    "grads-reduce-scatter": ("reduce_scatter", "dp"),
    "params-all-gather": ("all_gather", "dp"),
    "separate-grads-all-reduce": ("all_reduce", "dp"),
    "layernorm-grads-all-reduce": ("all_reduce", "tp"),
    "embedding-grads-all-reduce": ("all_reduce", "embedding"),
    "optimizer-clip-main-grad": ("all_reduce", "world"),
}
P2P = ("forward-send", "forward-recv", "backward-send", "backward-recv")
KNOWN = set(SPAN_OF) | set(COLL_OF) | set(P2P) | {"first-op"}


def read_meta(path: str) -> dict[str, int]:
    """The job's sizes from the meta file (YAML, read with PyYAML's safe loader)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise TraceError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise TraceError(f"{path}: not a YAML mapping of the job's sizes")
    raw = {str(k): str(v) for k, v in loaded.items() if v is not None}
    sizes: dict[str, int] = {}
    for key in SIZES:
        value = raw.get(key, "1" if key in ("dsp_size", "vpp_size") else None)
        if value is None:
            raise TraceError(f"{path}: no {key}")
        try:
            sizes[key] = int(value)
        except ValueError:
            raise TraceError(f"{path}: {key}={value!r} is not an integer") from None
        if sizes[key] < 1:
            raise TraceError(f"{path}: {key}={sizes[key]} is not positive")
    product = sizes["dp_size"] * sizes["pp_size"] * sizes["tp_size"] * sizes["dsp_size"]
    if product != sizes["world_size"]:
        raise TraceError(
            f"{path}: dp_size x pp_size x tp_size x dsp_size = {product}, "
            f"not world_size {sizes['world_size']}"
        )
    if sizes["world_size"] > MAX_WORLD:
        raise TraceError(f"{path}: world_size {sizes['world_size']} is more than {MAX_WORLD}")
    sizes["trial_name"] = raw.get("trial_name", "")  # type: ignore[assignment]
    return sizes


def read_trace(path: str) -> pd.DataFrame:
    """The trace's rows, checked: Parquet, the schema's columns, integers where they must be."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{path}: not a Parquet file ({str(e).splitlines()[0][:120]})") from None
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise TraceError(f"{path}: missing column(s) {', '.join(missing)} of the what-if schema")
    df = table.to_pandas()
    df["optype"] = df["optype"].astype(str)
    for col in OPTIONAL_INT:
        if col not in df.columns:
            df[col] = -1
    for col in ("dp_rank", "stage", "rank", "step", "seq_id", *OPTIONAL_INT):
        if not pd.api.types.is_integer_dtype(df[col]):
            raise TraceError(f"{path}: column {col} is {df[col].dtype}, not integers")
        df[col] = df[col].astype(np.int64)
    for col in ("start_ts", "duration"):
        if not pd.api.types.is_numeric_dtype(df[col]):
            raise TraceError(f"{path}: column {col} is {df[col].dtype}, not numbers")
        df[col] = df[col].astype(np.float64)
    if df.empty:
        raise TraceError(f"{path}: no rows")
    unknown = sorted(set(df["optype"].unique()) - KNOWN)
    if unknown:
        raise TraceError(f"{path}: unknown optype(s) {', '.join(unknown[:5])}")
    return df


def _check(df: pd.DataFrame, sizes: Mapping[str, int], path: str) -> None:
    world, pp = sizes["world_size"], sizes["pp_size"]
    dp_span = sizes["dp_size"] * sizes["dsp_size"]
    for col, limit in (("rank", world), ("stage", pp), ("dp_rank", dp_span)):
        bad = df[(df[col] < 0) | (df[col] >= limit)]
        if len(bad):
            raise TraceError(f"{path}: {col} {int(bad[col].iloc[0])} outside 0..{limit - 1}")
    if not np.isfinite(df["start_ts"]).all() or not np.isfinite(df["duration"]).all():
        raise TraceError(f"{path}: start_ts or duration is not finite")
    per_rank = df.groupby("rank")[["dp_rank", "stage"]].nunique()
    if (per_rank > 1).any(axis=None):
        raise TraceError(f"{path}: a rank appears with two (dp_rank, stage) coordinates")


def _coords(df: pd.DataFrame, sizes: Mapping[str, int]) -> dict[int, dict[str, int]]:
    """Each recorded rank's [dp, pp, tp, cp]: the trace's dp_rank and stage, tp and cp (dsp) from
    the rank (a dp_rank past dp_size counts dp x dsp, dsp innermost)."""
    mesh = _mesh(sizes)
    out: dict[int, dict[str, int]] = {}
    for rank, dp_rank, stage in (
        df[["rank", "dp_rank", "stage"]].drop_duplicates().itertuples(index=False)
    ):
        c = coords_of(int(rank), mesh)
        if sizes["dsp_size"] > 1 and df["dp_rank"].max() >= sizes["dp_size"]:
            c["dp"], c["cp"] = divmod(int(dp_rank), sizes["dsp_size"])
        else:
            c["dp"] = int(dp_rank)
        c["pp"] = int(stage)
        out[int(rank)] = c
    return out


def _mesh(sizes: Mapping[str, int]) -> dict[str, int]:
    return {"dp": sizes["dp_size"], "pp": sizes["pp_size"], "tp": sizes["tp_size"],
            "cp": sizes["dsp_size"]}  # fmt: skip


def _groups(sizes: Mapping[str, int], coords: Mapping[int, Mapping[str, int]]) -> list[dict]:
    """The process groups the collectives name, over the whole world (SPEC rank order, with the
    recorded ranks' own coordinates): dp (dp x dsp), tp, pp, embedding (first and last stage),
    world."""
    mesh = _mesh(sizes)
    world = sizes["world_size"]
    where = [dict(coords.get(r) or coords_of(r, mesh)) for r in range(world)]
    keys = {
        "dp": lambda c: (c["pp"], c["tp"]),
        "tp": lambda c: (c["pp"], c["dp"], c["cp"]),
        "pp": lambda c: (c["dp"], c["cp"], c["tp"]),
    }
    groups: list[dict[str, Any]] = []
    for name, key in keys.items():
        found: dict[tuple, list[int]] = {}
        for r, c in enumerate(where):
            found.setdefault(key(c), []).append(r)
        groups += [{"name": name, "ranks": rs} for rs in found.values() if len(rs) > 1]
    last = sizes["pp_size"] - 1
    found = {}
    for r, c in enumerate(where):
        if c["pp"] in (0, last):
            found.setdefault(keys["pp"](c), []).append(r)
    groups += [{"name": "embedding", "ranks": rs} for rs in found.values() if len(rs) > 1]
    if world > 1:
        groups.append({"name": "world", "ranks": list(range(world))})
    return groups


def _step_offsets(df: pd.DataFrame) -> dict[int, float]:
    """Where each step begins on the run's clock (seconds after BASE_NS): one after the other."""
    spans = (
        df.assign(end=df.start_ts + df.duration)
        .groupby("step")
        .agg(lo=("start_ts", "min"), hi=("end", "max"))
    )
    offsets, t = {}, 0.0
    for step, lo, hi in spans.itertuples():
        offsets[int(step)] = t - lo
        t += hi - lo + STEP_GAP_S
    return offsets


def _pair_p2p(df: pd.DataFrame, sizes: Mapping[str, int]) -> tuple[pd.DataFrame, int]:
    """The live send/recv rows with their peer and a per-pair sequence number.

    The k-th send (recv) of a direction on a worker belongs to the k-th compute of that
    direction (a recv list one short lacks the first); it is a no-op when that compute's chunk
    is the model's last (forward send, backward recv) or first (forward recv, backward send).
    The live ones pair in order with the peer stage's live ones of the matching kind.
    """
    pp, vpp = sizes["pp_size"], sizes["vpp_size"]
    last_gmc = pp * vpp - 1
    p2p = df[df.optype.isin(P2P)].copy()
    if p2p.empty:
        return p2p.assign(peer=[], pair_seq=[], live=[]), 0
    comp = df[df.optype.isin(("forward-compute", "backward-compute"))]
    comp = comp.sort_values(["rank", "step", "optype", "start_ts", "seq_id"])
    gmcs: dict[tuple[int, int, str], np.ndarray] = {
        (int(r), int(s), str(o)): g["gmc"].to_numpy()
        for (r, s, o), g in comp.groupby(["rank", "step", "optype"], sort=False)
    }
    p2p = p2p.sort_values(["rank", "step", "optype", "start_ts", "seq_id"])
    live = np.ones(len(p2p), dtype=bool)
    pos = 0
    for (rank, step, optype), g in p2p.groupby(["rank", "step", "optype"], sort=False):
        direction, kind = optype.split("-")
        g_comp = gmcs.get((int(rank), int(step), f"{direction}-compute"))
        n = len(g)
        flags = np.ones(n, dtype=bool)
        if g_comp is not None and len(g_comp) and (g_comp >= 0).all():
            shift = len(g_comp) - n
            if 0 <= shift <= 1:
                chunk = g_comp[shift:]
                first_end = (direction == "forward") == (kind == "recv")
                edge = 0 if first_end else last_gmc
                flags = chunk != edge
        elif pp == 1:
            flags[:] = False
        live[pos : pos + n] = flags
        pos += n
    p2p["live"] = live
    dropped = int((~live).sum())
    p2p = p2p[p2p.live].copy()
    step_sign = {"forward-send": 1, "forward-recv": -1, "backward-send": -1, "backward-recv": 1}
    p2p["peer_stage"] = (p2p.stage + p2p.optype.map(step_sign)) % pp
    p2p["k"] = p2p.groupby(["rank", "step", "optype"]).cumcount()
    return p2p, dropped


def _p2p_peers(
    p2p: pd.DataFrame, coords: Mapping[int, Mapping[str, int]], sizes: Mapping[str, int]
) -> pd.DataFrame:
    """Each live send/recv's peer rank (same dp, dsp and tp coordinates, the peer stage) and its
    sequence number on the (sender, receiver) pair."""
    mesh = _mesh(sizes)
    at = {(c["dp"], c["cp"], c["tp"], c["pp"]): r for r, c in coords.items()}
    peers = []
    for rank, ps in zip(p2p["rank"].to_numpy(), p2p["peer_stage"].to_numpy(), strict=True):
        c = coords[int(rank)]
        key = (c["dp"], c["cp"], c["tp"], int(ps))
        peers.append(at.get(key, rank_of({**c, "pp": int(ps)}, mesh)))
    p2p["peer"] = np.array(peers, dtype=np.int64)
    # numbered on both ends in the same order: by step, direction, k-th of the step
    p2p["dir"] = p2p.optype.str.split("-").str[0]
    p2p["kind"] = p2p.optype.str.split("-").str[1]
    p2p = p2p.sort_values(["rank", "peer", "kind", "step", "dir", "k"])
    p2p["pair_seq"] = p2p.groupby(["rank", "peer", "kind"]).cumcount()
    return p2p


def _span_table(df: pd.DataFrame, t0: np.ndarray, t1: np.ndarray) -> dict[str, Any]:
    names = df.optype.map(lambda o: SPAN_OF[o][0])
    kinds = df.optype.map(lambda o: SPAN_OF[o][1])
    mb = np.where(df.optype.isin(("forward-compute", "backward-compute")), df.mb_id, -1)
    return {
        "rank": df["rank"].to_numpy(np.int32), "step": df["step"].to_numpy(np.int32),
        "microbatch": mb.astype(np.int32), "name": names.tolist(), "kind": kinds.tolist(),
        "start_ns": t0, "end_ns": t1, "source": ["whatif"] * len(df),
    }  # fmt: skip


def import_whatif(trace: str, meta_path: str, out: str) -> ImportResult:
    """Import one trace of the what-if schema into the run directory ``out``."""
    sizes = read_meta(meta_path)
    df = read_trace(trace)
    _check(df, sizes, trace)
    created = prepare_out_dir(out)
    try:
        return _write(df, sizes, trace, meta_path, out)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _write(df: pd.DataFrame, sizes: dict, trace: str, meta_path: str, out: str) -> ImportResult:
    df = df[df.optype != "first-op"].reset_index(drop=True)
    coords = _coords(df, sizes)
    offsets = _step_offsets(df)
    off = df.step.map(offsets).to_numpy()
    t0 = BASE_NS + np.rint((df.start_ts.to_numpy() + off) * 1e9).astype(np.int64)
    t1 = t0 + np.rint(np.maximum(df.duration.to_numpy(), 0.0) * 1e9).astype(np.int64)
    df["t0"], df["t1"] = t0, t1
    groups = _groups(sizes, coords)
    rows = {"spans": 0, "collectives": 0}

    p2p, dropped = _pair_p2p(df, sizes)
    p2p = _p2p_peers(p2p, coords, sizes) if len(p2p) else p2p
    coll = _numbered_collectives(df)
    spans = df[df.optype.isin(list(SPAN_OF))]
    steps = df.groupby(["rank", "step"]).agg(t0=("t0", "min"), t1=("t1", "max")).reset_index()
    mesh = _mesh(sizes)
    for rank in sorted(coords):
        rows["spans"] += _write_spans(out, rank, spans, steps)
        rows["collectives"] += _write_collectives(out, rank, coll, p2p, sizes)
        _write_topology(out, rank, coords[rank])
    world = sizes["world_size"]
    recorded = sorted(coords)
    _write_meta(out, sizes, mesh, groups, coords, [trace, meta_path], offsets, dropped)
    notes = []
    if len(recorded) < world:
        notes.append(f"{world - len(recorded)} ranks not recorded (one worker per tp group)")
    if dropped:
        notes.append(f"{dropped} no-op send/recv left out")
    return ImportResult(run_dir=out, ranks=recorded, rows=rows, notes=notes)


def _numbered_collectives(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of a collective op type, with the op and group each stands for and its number
    in that group on its rank."""
    coll = df[df.optype.isin(list(COLL_OF))].copy()
    coll["op"] = coll.optype.map(lambda o: COLL_OF[o][0])
    coll["group"] = coll.optype.map(lambda o: COLL_OF[o][1])
    coll = coll.sort_values(["rank", "group", "step", "t0", "optype", "seq_id"])
    coll["seq"] = coll.groupby(["rank", "group"]).cumcount()
    return coll


def _write_spans(out: str, rank: int, spans: pd.DataFrame, steps: pd.DataFrame) -> int:
    """Write one rank's spans part (its compute spans and a ``step`` span per step); returns
    its rows."""
    s = spans[spans["rank"] == rank]
    cols = _span_table(s, s.t0.to_numpy(), s.t1.to_numpy())
    st = steps[steps["rank"] == rank]
    n = len(st)
    for k, v in {
        "rank": np.full(n, rank, np.int32), "step": st.step.to_numpy(np.int32),
        "microbatch": np.full(n, -1, np.int32), "name": ["step"] * n, "kind": ["host"] * n,
        "start_ns": st.t0.to_numpy(), "end_ns": st.t1.to_numpy(), "source": ["whatif"] * n,
    }.items():  # fmt: skip
        cols[k] = np.concatenate([np.asarray(cols[k]), np.asarray(v)])
    write_part(out, "spans", rank, cols)
    return len(cols["rank"])


def _write_collectives(
    out: str, rank: int, coll: pd.DataFrame, p2p: pd.DataFrame, sizes: dict
) -> int:
    """Write one rank's collectives part (its collectives, then its sends and receives), where
    it has any; returns its rows."""
    size_of = {"dp": sizes["dp_size"] * sizes["dsp_size"], "tp": sizes["tp_size"],
               "embedding": 2 if sizes["pp_size"] > 1 else 1, "world": sizes["world_size"]}  # fmt: skip
    c = coll[coll["rank"] == rank]
    p = p2p[p2p["rank"] == rank] if len(p2p) else p2p
    ops = c.op.tolist() + [o.split("-")[1] for o in p.optype] if len(p) else c.op.tolist()
    n_c, n_p = len(c), len(p)
    ccols = {
        "rank": np.full(n_c + n_p, rank, np.int32),
        "step": np.concatenate([c.step.to_numpy(), p.step.to_numpy() if n_p else []]),
        "microbatch": np.full(n_c + n_p, -1, np.int32),
        "op": ops,
        "group": c.group.tolist() + ["pp"] * n_p,
        "group_size": np.array([size_of[g] for g in c.group] + [sizes["pp_size"]] * n_p, np.int32),
        "seq": np.concatenate([c.seq.to_numpy(), p.pair_seq.to_numpy() if n_p else []]),
        "peer": np.concatenate([np.full(n_c, -1), p.peer.to_numpy() if n_p else []]),
        "nbytes": np.zeros(n_c + n_p, np.int64),
        "dtype": [None] * (n_c + n_p),
        "issue_ns": np.concatenate([c.t0.to_numpy(), p.t0.to_numpy() if n_p else []]),
        "start_ns": np.concatenate([c.t0.to_numpy(), p.t0.to_numpy() if n_p else []]),
        "end_ns": np.concatenate([c.t1.to_numpy(), p.t1.to_numpy() if n_p else []]),
        "source": ["whatif"] * (n_c + n_p),
    }
    for k in ("step", "seq", "peer", "issue_ns", "start_ns", "end_ns"):
        ccols[k] = np.asarray(ccols[k]).astype(np.int32 if k in ("step", "peer") else np.int64)
    if n_c + n_p:
        write_part(out, "collectives", rank, ccols)
    return n_c + n_p


def _write_topology(out: str, rank: int, cc: dict[str, int]) -> None:
    """Write one rank's topology part: its coordinates, no host."""
    write_part(out, "topology", rank, {
        "rank": [rank], "host": [""], "local_rank": [-1], "pid": [-1], "device": ["cuda"],
        "gpu_uuid": [None], "dp": [cc["dp"]], "pp": [cc["pp"]], "tp": [cc["tp"]],
        "cp": [cc["cp"]], "clock_offset_ns": [0],
    })  # fmt: skip


def _write_meta(
    out: str,
    sizes: dict,
    mesh: dict[str, int],
    groups: list[dict],
    coords: dict[int, dict[str, int]],
    files: list[str],
    offsets: dict[int, float],
    dropped: int,
) -> None:
    """Write the run's run.json: the mesh and groups, every rank's coordinates and where the
    run came from (the trace's files, its recorded ranks and steps)."""
    world = sizes["world_size"]
    all_coords = [coords.get(r) or coords_of(r, mesh) for r in range(world)]
    recorded = sorted(coords)
    source = {
        "tool": "whatif",
        "files": [os.path.basename(f) for f in files],
        "trial_name": sizes.get("trial_name") or None,
        "dsp_size": sizes["dsp_size"],
        "vpp_size": sizes["vpp_size"],
        "recorded_ranks": recorded,
        "unrecorded_ranks": world - len(recorded),
        "steps": sorted(int(s) for s in offsets),
        "left_out_noop_p2p": dropped,
    }
    meta = write_run_json(out, world_size=world, mesh=mesh, groups=groups, device="cuda",
                          status="finished", source=source)  # fmt: skip
    meta["coords"] = [[c["dp"], c["pp"], c["tp"], c["cp"]] for c in all_coords]
    meta["started_at"] = "2026-01-01T00:00:00Z"
    meta["summary"] = {"steps": len(offsets)}
    from tracer.rundir import write_json_atomic

    write_json_atomic(os.path.join(out, "run.json"), meta)
